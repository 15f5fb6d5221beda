"""The Triton kernels of the statistics engine. Importing this package needs Triton; ``..launch`` imports it on the
first launch only, and fused kernels through ``..device``.

Modules by job: ``consts`` (compile-time constants and layouts), ``hist`` (the log2 histogram in shared memory),
``tile`` (per-tile statistics, fast and careful, and per-program results), ``words`` (bf16 two at a time), ``merge``
(partials into a row), ``standalone`` (the multi-tensor statistics kernel), ``fused`` (helpers fused kernels call).
"""
