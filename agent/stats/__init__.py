"""The statistics engine: SPEC section-4 statistics of tensors, as mergeable rows.

* ``reference``: the fp64 oracle (``Moments``, ``tensor_stats``) every path is tested against.
* ``layout``: the row, partial and table layouts, defined once.
* ``torch_path``: rows with plain torch ops on any device (the CPU path, and the reference of the Triton path).
* ``launch``: the Triton path's host API (``rows``, ``Target``, ``defer``, ``flush_deferred``, ...); ``engine``: the
  per-device state every launch on a device shares; ``staging``: host-to-device copies without a host sync.
* ``device``: the documented device API fused kernels call; ``kernels``: the Triton kernels (need Triton).
"""

from .reference import Moments, merge_moments, merge_stats, per_sample_kurtosis, tensor_stats

__all__ = ["Moments", "merge_moments", "merge_stats", "per_sample_kurtosis", "tensor_stats"]
