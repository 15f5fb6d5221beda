"""The baseline a user would write instead of fp8mon's agent: plain torch hooks on every ``nn.Linear`` computing
mean, std, amax and kurtosis of the layer's input, output and output gradient (3 sites) with torch ops on every
reporting step (``step % every == 0``), kept as device tensors (no ``.item()`` per tensor), and read to the host
once per reporting step in ``end_step`` (one ``.tolist()``, as a ``wandb.log`` of the values would)."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["NaiveStats"]

SITES = ("input", "output", "grad_output")


def _moments(x: torch.Tensor) -> torch.Tensor:
    x = x.detach().float()
    mean = x.mean()
    d = x - mean
    var = d.square().mean()
    return torch.stack([mean, var.sqrt(), x.abs().amax(), d.pow(4).mean() / var.square()])


class NaiveStats:
    """Forward hooks (input, output) and a tensor hook on each output (grad_output) of every ``nn.Linear``."""

    def __init__(self, model: nn.Module, every: int):
        self.every = every
        self.reporting = True
        self.rows: dict[str, torch.Tensor] = {}  # "layer/site" -> [mean, std, amax, kurtosis] of this step
        self.linears = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
        self._handles = [m.register_forward_hook(self._hook(name)) for name, m in self.linears]
        self.last: dict[str, list[float]] = {}

    def _hook(self, name: str):
        def forward(module, args, output):
            if not self.reporting or not module.training:
                return
            self.rows[f"{name}/input"] = _moments(args[0])
            self.rows[f"{name}/output"] = _moments(output)
            if output.requires_grad:
                output.register_hook(lambda grad: self._grad(name, grad))

        return forward

    def _grad(self, name: str, grad: torch.Tensor) -> None:
        self.rows[f"{name}/grad_output"] = _moments(grad)

    def end_step(self, step: int) -> int:
        """Close ``step`` (read its rows to the host if it reported); the rows it wrote. The next step's
        reporting is decided here."""
        written = len(self.rows)
        if self.rows:
            values = torch.stack(list(self.rows.values())).tolist()
            self.last = dict(zip(self.rows, values))
            self.rows = {}
        self.reporting = (step + 1) % self.every == 0
        return written

    def begin(self, step: int) -> None:
        """Declare the step about to run (after a jump of the step counter)."""
        self.reporting = step % self.every == 0

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
