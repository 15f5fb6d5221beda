"""torchao float8 training (``torchao.float8.convert_to_float8_training``): the casts a ``Float8Linear`` really does.

A ``Float8Linear`` is an ``nn.Linear`` (watched under the same names) whose three GEMMs cast their operands to FP8
dynamically, each operand once per GEMM it enters (torchao's ``matmul_with_hp_or_float8_args``), with the
``CastConfig`` of its ``Float8LinearConfig`` for that GEMM:

=============  ==================================  ============================================
site           GEMM output / grad_input            GEMM grad_weight
=============  ==================================  ============================================
input          ``cast_config_input``, per row      ``cast_config_input_for_grad_weight``, per
               (token)                             column (feature; dim 0 of input.reshape(-1, K))
weight         ``cast_config_weight``, per output  (grad_input:) ``cast_config_weight_for_grad_input``,
               feature                             per input feature
grad_output    (grad_input:) ``cast_config_grad_   ``cast_config_grad_output_for_grad_weight``,
               output``, per row                   per column
=============  ==================================  ============================================

"Per row/column" holds for rowwise ("axiswise") casts; a tensorwise cast has one scale. A cast's FP8 format is its
config's ``target_dtype``: e4m3 for input and weight, e5m2 for grad_output under the tensorwise recipe, e4m3 under
the rowwise ones. A disabled cast (``ScalingType.DISABLED``) leaves its GEMM in high precision, as
``rowwise_with_gw_hp`` does for grad_weight's GEMM. The scales are torchao's own ``tensor_to_scale`` of the same
tensor with the same arguments (granularity, axis, ``round_scales_to_power_of_2``, the EPS clamp of amax), so they
are the layer's, bit for bit; the input is the one the layer casts (converted to the autocast dtype under autocast).

A site's row then describes what torchao's casts of that tensor lose: underflow and overflow count the elements lost
in any of its casts (an element flushed in grad_weight's GEMM is lost there even if the forward kept it), its scale is
the smallest scale in use (tensorwise: the scale). Sites that torchao never casts to FP8 (output, grad_weight, and an
operand whose casts are all disabled) carry no format: no underflow, overflow or scale, whatever the agent's
``formats`` say. Rowwise sites go through the torch statistics path: the Triton kernels take one scale per tensor.

torchao is imported only when a model already uses it: the agent works without it.
"""

from __future__ import annotations

import logging
import sys

import torch
from torch import nn

from .formats import Fp8Format, by_name

__all__ = ["SiteCast", "describe", "site_casts"]

log = logging.getLogger("fp8mon.agent")

# site -> (the config attribute of each of its casts, axiswise dim on the operand's 2-D view), in the order of torchao's
# matmul_with_hp_or_float8_args; the weight's view is weight.t() [in, out], the others' x.reshape(-1, x.shape[-1])
_CASTS = {
    "input": (("cast_config_input", -1), ("cast_config_input_for_grad_weight", 0)),
    "weight": (("cast_config_weight", 0), ("cast_config_weight_for_grad_input", -1)),
    "grad_output": (("cast_config_grad_output", -1), ("cast_config_grad_output_for_grad_weight", 0)),
}
_GEMMS = {"cast_config_input": "output", "cast_config_input_for_grad_weight": "grad_weight",
          "cast_config_weight": "output", "cast_config_weight_for_grad_input": "grad_input",
          "cast_config_grad_output": "grad_input", "cast_config_grad_output_for_grad_weight": "grad_weight"}
_UNCAST = ("output", "grad_weight")  # GEMM results: torchao keeps them in high precision


def _float8_linear() -> type | None:
    """torchao's Float8Linear class, if torchao's float8 training is loaded (a model converted to it has loaded it)."""
    module = sys.modules.get("torchao.float8.float8_linear")
    return getattr(module, "Float8Linear", None)


class SiteCast:
    """The casts of one site of a Float8Linear. ``cast(x)`` -> (the tensor as the layer casts it, its FP8 format
    or None when nothing is cast, its scales: None, one scale, or a list of one per cast; each broadcasts to that
    tensor). The agent's statistics of the site take these instead of its own scaling emulation."""

    def __init__(self, site: str, fmt: Fp8Format | None, dtype: torch.dtype | None,
                 casts: tuple[tuple[object, int | None], ...], round_scales_to_power_of_2: bool):
        self.site, self.fmt, self.dtype = site, fmt, dtype
        self.casts = casts  # (torchao ScalingGranularity, axiswise dim or None), one per distinct cast
        self.round_scales_to_power_of_2 = round_scales_to_power_of_2

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, Fp8Format | None, object]:
        if self.fmt is None or not self.casts:
            return x, None, None
        from torchao.float8.float8_utils import tensor_to_scale

        if self.site == "input" and torch.is_autocast_enabled("cuda"):  # as Float8Linear.forward does
            x = x.to(torch.get_autocast_dtype("cuda"))
        weight = self.site == "weight"
        view = x.t() if weight else x.reshape(-1, x.shape[-1])
        scales = []
        for granularity, dim in self.casts:
            s = tensor_to_scale(view.detach(), self.dtype, scaling_granularity=granularity, axiswise_dim=dim,
                                round_scales_to_power_of_2=self.round_scales_to_power_of_2)
            scales.append(s.t() if weight and s.dim() == 2 else s)
        return (x if weight else view), self.fmt, scales[0] if len(scales) == 1 else scales


def _casts_of(config, site: str) -> tuple[torch.dtype | None, tuple, list[str]]:
    """(target dtype, distinct (granularity, axiswise dim) casts, their descriptions) of ``site`` under ``config``."""
    from torchao.float8.config import ScalingGranularity, ScalingType

    dtype, casts, described = None, [], []
    for attribute, dim in _CASTS[site]:
        cc = getattr(config, attribute)
        gemm = _GEMMS[attribute]
        if cc.scaling_type is ScalingType.DISABLED:
            described.append(f"high precision ({gemm} GEMM)")
            continue
        dtype = cc.target_dtype  # torchao asserts one dtype for both casts of an operand
        rowwise = cc.scaling_granularity is ScalingGranularity.AXISWISE
        key = (cc.scaling_granularity, dim if rowwise else None)
        if key not in casts:
            casts.append(key)
        described.append(f"{'rowwise' if rowwise else 'tensorwise'} ({gemm} GEMM)")
    return dtype, tuple(casts), described


def site_casts(module: nn.Module) -> dict[str, SiteCast]:
    """The ``SiteCast`` of every site of ``module`` when it is torchao's Float8Linear, else {}. A site whose FP8
    dtype the agent has no format for (ROCm's fnuz types) is left to the agent's own emulation, with a warning."""
    cls = _float8_linear()
    if cls is None or not isinstance(module, cls):
        return {}
    config = module.config
    pow2 = bool(getattr(config, "round_scales_to_power_of_2", False))
    out = {site: SiteCast(site, None, None, (), pow2) for site in _UNCAST}
    for site in _CASTS:
        dtype, casts, _ = _casts_of(config, site)
        if not casts:
            out[site] = SiteCast(site, None, None, (), pow2)
            continue
        name = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}.get(dtype)
        if name is None:
            log.warning("fp8mon agent: torchao casts %s to %s, which has no fp8mon format; its statistics use the "
                        "agent's own scaling", site, dtype)
            continue
        out[site] = SiteCast(site, by_name(name), dtype, casts, pow2)
    return out


def describe(module: nn.Module) -> dict[str, str]:
    """What ``module`` (torchao's Float8Linear) does with each site, e.g. ``{"input": "e4m3: rowwise (output GEMM),
    rowwise (grad_weight GEMM)", "output": "not cast", ...}``; {} for any other module."""
    cls = _float8_linear()
    if cls is None or not isinstance(module, cls):
        return {}
    out = {}
    for site in _CASTS:
        dtype, casts, described = _casts_of(module.config, site)
        fmt = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}.get(dtype, str(dtype))
        out[site] = f"{fmt}: {', '.join(described)}" if casts else "not cast (high precision)"
    if getattr(module.config, "round_scales_to_power_of_2", False):
        out = {k: v + ", scales rounded down to powers of 2" if not v.startswith("not") else v for k, v in out.items()}
    return {**out, **{site: "not cast (high precision)" for site in _UNCAST}}

