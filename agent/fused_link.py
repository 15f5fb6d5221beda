"""``FusedLink``: what the agent puts in a self-reporting layer's ``fp8mon_stats`` (the trainer's ``Fp8Linear``, whose
kernels emit the rows of their tensors from the reads they do anyway)."""

from __future__ import annotations

import torch

from .sink import REPLACED


class FusedLink:
    """The sites a layer reports itself, and

    * ``target(site, device)``: a ``stats.launch.Target`` for the layer's kernel (None: not this step);
    * ``wants(site)`` / ``report(site, row)``: for a layer without such kernels (e.g. on the CPU), which
      computes a ``stats.torch_path`` row itself and hands it over.
    """

    def __init__(self, agent, layer: str, sites: tuple[str, ...], grad_by_cast: bool = False):
        self.agent, self.layer, self.sites, self.grad_by_cast = agent, layer, sites, grad_by_cast

    def grad_weight_target(self, device):
        """A target for the row of the layer's weight gradient, for a layer that casts that gradient to its weight's
        dtype (``fp8mon_grad_weight_by_cast``, a watched grad_weight) where the cast's result becomes ``.grad`` as it
        is (no gradient accumulated yet in this step): None when not this step. Name the result with
        ``took_grad_weight``; the hook then leaves it alone. A later micro-batch, whose gradient is added to it, asks
        for none and the hook reads the sum, replacing the row."""
        agent = self.agent
        if not (self.grad_by_cast and agent.reporting) or agent._history is not None:  # delayed: the hooks' history
            return None
        return self._claimed("grad_weight", device)

    def took_grad_weight(self, grad: torch.Tensor, target) -> None:
        """``grad`` (the gradient the cast returned, written with its row into ``target``) as the step's gradient of the
        layer's weight: its hook leaves it alone, and gradient clipping may take its norm from the row."""
        self.agent._sink.cast_grads[self.layer] = (grad.data_ptr(), grad._version, int(target.index))

    def target(self, site: str, device):
        if site not in self.sites:
            return None
        return self._claimed(site, device)

    def _claimed(self, site: str, device):
        """The agent's target for ``site`` (claimed), or None with the failure counted."""
        try:
            return self.agent._sink.fused_target(self.layer, site, device)
        except Exception as exc:
            self.agent._error("fused target", exc)
            return None

    def due(self, site: str) -> bool:
        """Whether ``target``/``wants`` would still ask for ``site``'s row this step (claims nothing)."""
        agent = self.agent
        if site not in self.sites or not agent.reporting:
            return False
        return site != "weight" or agent._slots.get(self.layer, site) not in agent._sink.seen

    def wants(self, site: str) -> bool:
        agent = self.agent
        if site not in self.sites or not agent.reporting:
            return False
        if site == "weight":
            slot = agent._slots.get(self.layer, site)
            if slot in agent._sink.seen:
                return False
            agent._sink.seen.add(slot)
        return True

    @property
    def outlier_k(self) -> float:
        return self.agent.outlier_k

    @property
    def hist(self) -> bool:
        return self.agent.hist_now

    def fmt(self, site: str):
        """The format the agent assumes for ``site`` (a tensor the layer does not cast itself), or None."""
        return self.agent.formats.get(site)

    def report(self, site: str, row: torch.Tensor) -> None:
        self.agent.report(self.layer, site, row, replace=site in REPLACED)
