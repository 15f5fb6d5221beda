"""fp8mon for Lightning: one callback::

    from fp8mon.integrations.lightning import Fp8monCallback

    trainer = L.Trainer(..., callbacks=[Fp8monCallback(url="http://127.0.0.1:8000", run="llama-fp8", every=10)])

It subclasses ``lightning.pytorch.Callback``, or ``pytorch_lightning.Callback`` where only that package is
installed. The callback takes the Agent's keyword arguments (url, run, token, every, modules, sites, config, tags,
...) or a ready ``agent=``. At train start (after the strategy set up torch.distributed and before the first
training batch) it makes the agent (run name: ``run=``, else $FP8MON_RUN, else the logger's name/version, else the
LightningModule's class name; config: the module's ``hparams`` (JSON values) under the given ``config``; tag
``framework=lightning``) and watches the LightningModule itself (never a strategy's wrapper; under DDP each rank
watches its replica, the agent reads the ranks from torch.distributed). It closes the agent at train end with
status "finished", on an exception (``on_exception``, KeyboardInterrupt too) with "failed".

Steps: the agent's steps are ``trainer.global_step`` as it stands while an optimizer step's batches run, the
x-axis of Lightning's own loggers: the first optimizer step is step 0, a run of ``max_steps=N`` reports steps
0..N-1. ``on_train_batch_start`` declares the step (``agent.step``); with ``accumulate_grad_batches=k`` the k
batches of one optimizer step all run under it, so their statistics are that step's (the grad_weight row is the
accumulated gradient the optimizer used). ``on_train_batch_end`` of the batch after which the optimizer stepped
(``global_step`` moved on) ends the step (``agent.log``) with its scalars: ``loss`` (the sum of the batches'
``outputs["loss"]``, which Lightning divides by k: the mean loss of the step), ``lr`` (the first parameter group's,
as the optimizer used it) and ``grad_norm`` (the total L2 norm of the module's gradients before any clipping, one
multi-tensor reduction on the device; not under sharding strategies, where a rank holds a part of them), read in
``on_before_optimizer_step``. With ``every=N`` statistics are sent on the steps that are multiples of N.
Validation between steps runs the module in eval mode, which the agent's hooks ignore.
"""

from __future__ import annotations

import torch

from ._attach import Attachment, guarded, json_safe, run_name

try:
    import lightning.pytorch as pl
except ImportError:
    try:
        import pytorch_lightning as pl  # type: ignore[no-redef]  # the same API under its older name
    except ImportError as exc:  # the optional dependency
        raise ImportError("fp8mon.integrations.lightning needs Lightning: pip install 'fp8mon[lightning]'") from exc

__all__ = ["Fp8monCallback"]

_SHARDING = ("FSDP", "DeepSpeed", "ModelParallel")  # strategies whose ranks each hold a part of the gradients


class Fp8monCallback(pl.Callback):
    """Attach an fp8mon Agent to a Lightning ``Trainer``: ``L.Trainer(callbacks=[Fp8monCallback(url=..., run=...,
    every=10)])``. Arguments: the Agent's keyword arguments, or ``agent=`` a ready Agent (watching the module
    already, or nothing yet), which the callback closes at train end too."""

    def __init__(self, *, agent=None, **agent_kwargs):
        self._attachment = Attachment("lightning", agent, agent_kwargs)
        self._step = 0  # the optimizer step whose batches run now
        self._scalars: dict = {}
        self._loss = None

    @property
    def agent(self):
        """The agent of the training in progress, or of the last one (closed); None before the first."""
        return self._attachment.agent

    def _live(self):
        return self._attachment.agent if self._attachment.live else None

    def on_train_start(self, trainer, pl_module):
        logger = trainer.logger
        logged = None
        if logger is not None and getattr(logger, "name", None):
            version = getattr(logger, "version", None)
            logged = logger.name if version is None else (
                f"{logger.name}/version_{version}" if isinstance(version, int) else f"{logger.name}/{version}")
        default = run_name(logged, type(pl_module).__name__)
        hparams = json_safe(getattr(pl_module, "hparams", None) or {})
        agent = self._attachment.start(pl_module, default, hparams)
        self._step, self._scalars, self._loss = trainer.global_step, {}, None
        agent.step(self._step)

    @guarded
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        agent = self._live()
        if agent is not None and trainer.global_step != self._step:
            self._step, self._scalars, self._loss = trainer.global_step, {}, None
            agent.step(self._step)

    @guarded
    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if self._live() is None:
            return
        self._scalars["lr"] = optimizer.param_groups[0]["lr"]
        if not any(s in c.__name__ for c in type(trainer.strategy).__mro__ for s in _SHARDING):
            grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
            if grads:
                self._scalars["grad_norm"] = torch.nn.utils.get_total_norm(grads, foreach=True)

    @guarded
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        agent = self._live()
        if agent is None:
            return
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if loss is not None and hasattr(loss, "detach"):
            loss = loss.detach()
            self._loss = loss if self._loss is None else self._loss + loss
        if trainer.global_step != self._step:  # the optimizer stepped after this batch: its step is done
            agent.log(self._step, loss=self._loss, **self._scalars)
            self._step, self._scalars, self._loss = trainer.global_step, {}, None

    @guarded
    def on_train_end(self, trainer, pl_module):
        self._attachment.finish("finished")

    @guarded
    def on_exception(self, trainer, pl_module, exception):
        self._attachment.finish("failed")

