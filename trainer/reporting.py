"""How a trainer module that computes a watched tensor tells the agent its statistics: the one protocol.

An fp8mon agent watches linear layers (``Agent.watch``) and records a statistics row per site of each (input, weight,
output, grad_output, grad_weight). Its hooks read a site's tensor unless the layer says that the site is reported for
it. A module whose kernel writes or reads such a tensor anyway (a norm writing a linear's input, a residual add
reading a linear's output) takes the row from that kernel's registers instead, sparing the hook's second read. It does
so through a ``SiteRow``, in three steps:

1. At construction (before ``Agent.watch``): ``SiteRow(linear, site, fuses)``. A linear that reports the site itself
   (``fp8mon_reported_sites`` on its class: ``Fp8Linear``'s casts take input, weight and grad_output) keeps it, except
   its ``output``: that it leaves to this module on the devices where ``fuses(device)`` holds
   (``linear.fp8mon_output_consumer``). Any other linear gets the site in its own ``fp8mon_reported_sites`` and an
   ``fp8mon_stats`` attribute: the agent skips the site in its hooks and puts its ``FusedLink`` in that attribute.
2. On each call: ``row.target(like)`` is the agent's ``fp8mon.agent.stats.launch.Target`` for the kernel's ``stats=`` argument, or
   None (no agent, not a reporting step, or the linear takes the row itself). Where the kernel does not run (no
   Triton: the CPU), ``row.report(value)`` computes the row with torch and hands it over instead.
3. A gradient's row is asked for in the backward: ``row.grad_target(like)`` is a callable for the kernel's backward,
   ``row.report_grad(output)`` hooks ``output``'s gradient on the torch path.

A module that needs more of the agent's link (the weight casts' batches, ``trainer.weight_rows``) calls ``claim`` and
uses the ``FusedLink`` in ``linear.fp8mon_stats`` itself.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


def triton_runs(device: torch.device) -> bool:
    """Whether the trainer's Triton kernels run on ``device``: CUDA with Triton, or the CPU under TRITON_INTERPRET."""
    from fp8mon.agent.stats import launch as stats_launch

    return stats_launch.available(device)


def claim(linear: nn.Module, *sites: str) -> None:
    """Mark ``sites`` of ``linear`` (one that does not report them itself) as reported by the module around it: the
    agent's hooks leave them alone and the agent puts its link in ``linear.fp8mon_stats``."""
    linear.fp8mon_reported_sites = (*getattr(linear, "fp8mon_reported_sites", ()), *sites)
    linear.fp8mon_stats = None


class SiteRow:
    """The row of ``site`` of ``linear``, taken by the module that computes that tensor (see the module docstring).
    ``fuses(device)``: whether that module's kernel, which takes the row, runs on ``device``."""

    def __init__(self, linear: nn.Module, site: str, fuses: Callable[[torch.device], bool] = triton_runs):
        self.linear, self.site, self.fuses = linear, site, fuses
        self.by_linear = site in getattr(type(linear), "fp8mon_reported_sites", ())
        if not self.by_linear:
            claim(linear, site)
        elif site == "output":
            linear.fp8mon_output_consumer = fuses

    def link(self, device: torch.device):
        """The agent's ``FusedLink`` through which this module reports on ``device`` now, or None."""
        if self.by_linear and not (self.site == "output" and self.fuses(device)):
            return None
        return getattr(self.linear, "fp8mon_stats", None)

    def target(self, like: torch.Tensor):
        """The target of the row for a kernel running on ``like``'s device, or None."""
        link = self.link(like.device)
        return link.target(self.site, like.device) if link is not None else None

    def grad_target(self, like: torch.Tensor) -> Callable[[], object] | None:
        """For a gradient's site: what the kernel's backward calls for its target (None: no row to take)."""
        link = self.link(like.device)
        return (lambda: link.target(self.site, like.device)) if link is not None else None

    def report(self, value: torch.Tensor) -> None:
        """``value``'s row, computed with torch and handed to the agent (no kernel took it)."""
        report_row(self.link(value.device), self.site, value)

    def report_grad(self, output: torch.Tensor) -> None:
        """The row of ``output``'s gradient, computed with torch when the backward reaches it."""
        link = self.link(output.device)
        if link is not None and output.requires_grad:
            output.register_hook(lambda grad: report_row(link, self.site, grad))


def report_row(link, site: str, value: torch.Tensor) -> None:
    """``value``'s row for ``site``, computed with torch and handed over through the agent's ``link`` (None: none)."""
    if link is not None and link.wants(site):
        from fp8mon.agent.stats import torch_path as ds

        link.report(site, ds.partials(value.detach(), fmt=link.fmt(site), outlier_k=link.outlier_k, hist=link.hist))
