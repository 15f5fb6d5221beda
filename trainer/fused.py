"""The drop-in modules of the trainer's fused kernels (``trainer.kernels``), chosen by ``trainer.parts.Parts``.

Each computes what its torch counterpart computes; where Triton runs (CUDA, or the CPU under TRITON_INTERPRET) as one
kernel each way, elsewhere with torch's ops (``trainer.torch_ops``). Given the linear whose tensor it writes or reads,
a module also takes that tensor's statistics row for an fp8mon agent, through ``trainer.reporting.SiteRow`` (the
protocol), from the kernel's registers: no hook reads the tensor again.

  RMSNorm      y = x / rms(x) * g; given ``feeds`` (the linear y feeds), that linear's input row
  ResidualAdd  x + branch; the row of the branch's last linear's output, and of its gradient (grad_output)
  RopeQKV      RoPE on the attention's qkv output, split into heads; qkv's output row and its gradient's
  MergeHeads   the attention's heads merged back for its projection
  SwiGLUAct    silu(gate) * up of fc1's output; fc1's output row, fc2's input row and fc1's grad_output row
  own_weight_row  a bf16 linear whose weight cast for autocast takes the weight's row, and its gradient's
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from . import reporting, torch_ops
from .reporting import SiteRow


def _runs(device: torch.device) -> bool:
    return reporting.triton_runs(device)  # (looked up at each call: a test may stand in for it)


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * g. ``learnable=False`` keeps g as a buffer (frozen, never in the optimizer):
    FOG's QK-norm gains are fixed at 1. ``feeds``: the linear whose input y is; its input row is then taken here (a
    plain linear's: an FP8 linear's cast takes its own). The kernels take contiguous rows (``kernels.rmsnorm.supports``)."""

    def __init__(self, dim: int, eps: float = 1e-6, init: float = 1.0, learnable: bool = True,
                 feeds: nn.Module | None = None):
        super().__init__()
        self.eps = eps
        gain = torch.full((dim,), float(init))
        if learnable:
            self.weight = nn.Parameter(gain)
        else:
            self.register_buffer("weight", gain)
        self.row = SiteRow(feeds, "input", _runs) if feeds is not None else None

    def fused(self, x: torch.Tensor) -> bool:
        """Whether the forward of x runs the Triton kernels."""
        if not _runs(x.device):
            return False
        from .kernels.rmsnorm import supports

        return supports(x, self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused(x):
            from .kernels.rmsnorm import rms_norm

            return rms_norm(x, self.weight, self.eps, stats=self.row.target(x) if self.row is not None else None)
        y = torch_ops.rms_norm(x, self.weight, self.eps)
        if self.row is not None:
            self.row.report(y)
        return y

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, learnable={isinstance(self.weight, nn.Parameter)}"


class ResidualAdd(nn.Module):
    """x + branch, the branch being ``writer``'s output: its output row is taken by the add's read of it, and its
    gradient's row (writer's grad_output) by the backward's cast of it."""

    def __init__(self, writer: nn.Module):
        super().__init__()
        self.out_row = SiteRow(writer, "output", _runs)
        self.grad_row = SiteRow(writer, "grad_output", _runs)

    def forward(self, x: torch.Tensor, branch: torch.Tensor) -> torch.Tensor:
        if _runs(x.device) and x.shape == branch.shape:
            from .kernels.residual import residual_add

            return residual_add(x, branch, stats=self.out_row.target(branch),
                                grad_stats=self.grad_row.grad_target(branch))
        self.out_row.report(branch)
        self.grad_row.report_grad(branch)
        return x + branch


class RopeQKV(nn.Module):
    """q, k, v (B, H, T, head_dim) of the attention's qkv output (B, T, 3 * d), q and k rotated (``rope``, a
    ``layers.Rotary``); ``qkv``'s output row taken by the kernel's read of it, its gradient's by the backward's write.
    The kernels take heads of a power of two from 16 (``kernels.rope.supported``)."""

    def __init__(self, qkv: nn.Module, n_head: int):
        super().__init__()
        self.n_head = n_head
        self.out_row = SiteRow(qkv, "output", _runs)
        self.grad_row = SiteRow(qkv, "grad_output", _runs)

    def forward(self, out: torch.Tensor, rope: nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, t, d = out.shape
        if _runs(out.device) and t <= rope.cos.shape[0]:
            from .kernels.rope import rope_qkv

            return rope_qkv(out, rope.cos, rope.sin, self.n_head, stats=self.out_row.target(out),
                            grad_stats=self.grad_row.grad_target(out))
        self.out_row.report(out)
        self.grad_row.report_grad(out)
        q, k, v = out.view(b, t, 3, self.n_head, d // (3 * self.n_head)).permute(2, 0, 3, 1, 4)
        return rope(q), rope(k), v


class MergeHeads(nn.Module):
    """The heads y (B, H, T, head_dim) as the projection's input (B, T, H * head_dim): one copy kernel where it runs
    (heads of a power of two from 8), torch's transpose and reshape elsewhere; the same values either way."""

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        b, h, t, hd = y.shape
        if _runs(y.device) and hd >= 8 and not hd & (hd - 1):
            from .kernels.heads import merge_heads

            return merge_heads(y)
        return y.transpose(1, 2).reshape(b, t, h * hd)


class SwiGLUAct(nn.Module):
    """h = silu(gate) * up of y = fc1's output [gate | up]: y's row (fc1's output), h's (fc2's input) and y's
    gradient's (fc1's grad_output) taken by the kernels that read and write them, the block's largest tensors."""

    def __init__(self, fc1: nn.Module, fc2: nn.Module):
        super().__init__()
        self.y_row = SiteRow(fc1, "output", _runs)
        self.h_row = SiteRow(fc2, "input", _runs)
        self.dy_row = SiteRow(fc1, "grad_output", _runs)

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        if _runs(y.device):
            from .kernels.swiglu import swiglu

            return swiglu(y, stats=self.y_row.target(y), h_stats=self.h_row.target(y),
                          dy_stats=self.dy_row.grad_target(y))
        h = torch_ops.swiglu(y)
        self.y_row.report(y)
        self.h_row.report(h)
        self.dy_row.report_grad(y)
        return h


def own_weight_row(linear: nn.Linear) -> nn.Linear:
    """``linear`` (a plain one; returned) reporting its weight's row itself. Autocast casts a bf16 model's weights at
    every step, a read of each: here that cast is one Triton kernel that also takes the weight's row on a reporting
    step (``kernels.residual.weight_cast``), and the first such linear of the step casts all their small weights in
    one launch (``trainer.weight_rows``). The cast back of the weight's gradient takes the gradient's row too, where
    that becomes ``.grad`` as it is (the step's first micro-batch; a later one's is added to it, and the hook reads the
    sum). Where no cast happens or the kernel cannot run (no autocast, no Triton), the linear reports the row apart."""
    if type(linear) is nn.Linear:
        reporting.claim(linear, "weight")
        linear.fp8mon_grad_weight_by_cast = True  # the hook reads the gradient unless the cast back took its row
        # an instance's forward (it stays an nn.Linear for the type checks); a partial, not a bound method, pickles
        linear.forward = functools.partial(_linear_with_weight_row, linear)
    return linear


def _linear_with_weight_row(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    link, w = self.fp8mon_stats, self.weight
    # (the hooks skip evaluation passes too; a weight not due may still have its cast from this step's batch)
    if link is None or not self.training or not (link.due("weight") or "fp8mon_cast_ready" in self.__dict__):
        return F.linear(x, w, self.bias)
    kind = x.device.type
    dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else w.dtype
    castable = dtype != w.dtype and w.dtype == torch.float32 and w.is_contiguous() and _runs(w.device)
    if castable:
        from . import weight_rows
        from .kernels.residual import weight_cast

        weight_rows.register_cast(self, link)
        cast = weight_rows.take_cast(self, link, dtype)  # this step's batch of weight casts (weight_rows)
        if cast is not None:
            return F.linear(x, cast, self.bias)
        if link.due("weight"):
            target = link.target("weight", w.device)
            if target is not None:
                return F.linear(x, weight_cast(w, dtype, target, link), self.bias)
    elif link.due("weight"):
        reporting.report_row(link, "weight", w)
    return F.linear(x, w, self.bias)
