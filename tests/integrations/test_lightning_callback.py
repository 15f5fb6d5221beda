"""The Lightning callback on real ``lightning.pytorch.Trainer`` runs of a tiny Llama on the CPU: the agent's steps are
``trainer.global_step`` (0..N-1, Lightning's logger x-axis), with the batches of gradient accumulation inside their
step, each step's loss, lr and grad_norm attached to it, and the run closed as finished or failed."""

import importlib
import math
import sys

import httpx
import lightning.pytorch as L
import pytest
import torch
from torch.utils.data import DataLoader

from fp8mon.agent import Agent
from fp8mon.integrations.lightning import Fp8monCallback
from tests.agent.capture import CaptureTransport
from tests.integrations.tiny import HIDDEN, SEQ, all_rows, sent_rows, sent_scalars, tiny_llama, token_examples

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.sqlite_only]

BATCH = 2
ROWS = all_rows("model.")  # the LightningModule is watched: its Llama is its attribute `model`


class TinyLlama(L.LightningModule):
    """Records what each optimizer step (by ``global_step``) saw: its batches' losses, the learning rate it used,
    the gradients before clipping."""

    def __init__(self, lr: float = 0.05, fail_at: int = -1):
        super().__init__()
        self.save_hyperparameters()
        self.model = tiny_llama()
        self.losses, self.lrs, self.grad_norms, self.head_grads = {}, {}, {}, {}

    def training_step(self, batch, batch_idx):
        step = self.trainer.global_step
        if step == self.hparams.fail_at:
            raise RuntimeError("diverged")
        loss = self.model(**batch).loss
        self.losses.setdefault(step, []).append(loss.item())
        self.lrs[step] = self.optimizers().param_groups[0]["lr"]
        return loss

    def on_before_optimizer_step(self, optimizer):
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        self.grad_norms[self.trainer.global_step] = torch.stack([g.norm() for g in grads]).norm().item()
        self.head_grads[self.trainer.global_step] = self.model.lm_head.weight.grad.clone()

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=self.hparams.lr)
        schedule = torch.optim.lr_scheduler.LinearLR(opt, start_factor=1.0, end_factor=0.1, total_iters=6)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def fit(module, callback, steps, accumulate=1, **trainer_args):
    data = DataLoader(token_examples(BATCH * accumulate * steps), batch_size=BATCH)
    trainer_args = {"logger": False, **trainer_args}
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, accumulate_grad_batches=accumulate, callbacks=[callback],
                        **trainer_args)
    trainer.fit(module, data)
    return trainer


def test_steps_are_global_steps_with_their_accumulated_batches_and_scalars():
    transport, module, steps = CaptureTransport(), TinyLlama(), 6
    callback = Fp8monCallback(transport=transport, every=1, hist=False)
    fit(module, callback, steps, accumulate=2, gradient_clip_val=0.5)

    assert callback.agent.errors == 0, callback.agent.last_error
    rows = sent_rows(transport)
    assert sorted(rows) == list(range(steps))
    for step, by_key in rows.items():
        assert set(by_key) == ROWS, f"step {step}: missing {sorted(ROWS - set(by_key))[:3]}"
        assert by_key[("model.model.layers.1.mlp.down_proj", "input")]["numel"] == 2 * BATCH * SEQ * 2 * HIDDEN
        assert math.isclose(by_key[("model.lm_head", "grad_weight")]["rms"],
                            module.head_grads[step].square().mean().sqrt(), rel_tol=1e-5)

    scalars = sent_scalars(transport)
    assert sorted(scalars) == list(range(steps))
    for step, got in scalars.items():
        assert got["loss"] == pytest.approx(sum(module.losses[step]) / 2, rel=1e-5)  # the mean of its 2 batches
        assert got["lr"] == pytest.approx(module.lrs[step])
        assert got["grad_norm"] == pytest.approx(module.grad_norms[step], rel=1e-5)  # before clipping to 0.5
    assert scalars[0]["lr"] > scalars[steps - 1]["lr"]

    meta = {k: v for m in transport.meta for k, v in m.items()}
    assert transport.meta[-1] == {"status": "finished"}
    assert meta["tags"]["framework"] == "lightning" and meta["config"] == {"lr": 0.05, "fail_at": -1}


def test_every_2_sends_statistics_on_even_steps_only():
    transport = CaptureTransport()
    callback = Fp8monCallback(transport=transport, every=2, hist=False)
    fit(TinyLlama(), callback, 5)

    assert callback.agent.errors == 0, callback.agent.last_error
    rows = sent_rows(transport)
    assert sorted(rows) == [0, 2, 4] and all(set(r) == ROWS for r in rows.values())
    assert sorted(sent_scalars(transport)) == [0, 1, 2, 3, 4]


def test_a_ready_agent_watching_the_module_already_is_used_as_it_is():
    transport, module = CaptureTransport(), TinyLlama()
    agent = Agent(transport=transport, every=1, hist=False, modules=r"lm_head").watch(module)
    callback = Fp8monCallback(agent=agent)
    fit(module, callback, 2)

    assert callback.agent is agent and agent.errors == 0, agent.last_error
    rows = sent_rows(transport)
    assert sorted(rows) == [0, 1] and all(set(r) == {k for k in ROWS if k[0] == "model.lm_head"} for r in rows.values())
    assert all(r[("model.lm_head", "input")]["numel"] == BATCH * SEQ * HIDDEN for r in rows.values())  # hooked once
    assert transport.meta[-1] == {"status": "finished"}
    with pytest.raises(RuntimeError, match="needs a new agent"):
        fit(module, callback, 2)


def test_an_exception_closes_the_run_as_failed():
    transport = CaptureTransport()
    callback = Fp8monCallback(transport=transport, every=1, hist=False)
    with pytest.raises(RuntimeError, match="diverged"):
        fit(TinyLlama(fail_at=3), callback, 6)

    assert transport.meta[-1] == {"status": "failed"}
    assert sorted(sent_scalars(transport)) == [0, 1, 2]
    assert {0, 1, 2} <= set(sent_rows(transport))


def test_a_missing_framework_names_the_extra_to_install(monkeypatch):
    for name in ("lightning", "lightning.pytorch", "pytorch_lightning"):
        monkeypatch.setitem(sys.modules, name, None)  # as in an install without Lightning
    monkeypatch.delitem(sys.modules, "fp8mon.integrations.lightning")
    with pytest.raises(ImportError, match=r"pip install 'fp8mon\[lightning\]'"):
        importlib.import_module("fp8mon.integrations.lightning")


def test_end_to_end_a_live_monitor_shows_the_run_under_the_logger_name(live_server, tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    callback = Fp8monCallback(url=live_server.url, every=2, spool_dir=tmp_path / "spool", flush_interval=0.05)
    module = TinyLlama()
    fit(module, callback, 4, logger=CSVLogger(tmp_path, name="tiny-llama"))  # no run name: the logger's
    assert callback.agent.errors == 0, callback.agent.last_error

    api = f"{live_server.url}/api/v1/runs/tiny-llama/version_0"
    run = httpx.get(api).json()
    assert run["status"] == "finished" and run["tags"] == {"framework": "lightning"}
    assert run["config"] == {"lr": 0.05, "fail_at": -1}
    catalogue = httpx.get(f"{api}/catalogue").json()
    assert {(layer["layer"], site) for layer in catalogue["layers"] for site in layer["sites"]} == ROWS
    loss = httpx.get(f"{api}/series", params={"scalar": "loss"}).json()["points"]
    assert loss["step"] == [0, 1, 2, 3] and loss["value"] == pytest.approx([module.losses[s][0] for s in range(4)])


def test_with_pytorch_lightning_alone(monkeypatch):
    import pytorch_lightning as pl

    monkeypatch.setitem(sys.modules, "lightning.pytorch", None)  # as in an install of pytorch_lightning only
    monkeypatch.delitem(sys.modules, "fp8mon.integrations.lightning")
    callbacks = importlib.import_module("fp8mon.integrations.lightning")
    assert issubclass(callbacks.Fp8monCallback, pl.Callback)

    class Tiny(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = tiny_llama()

        def training_step(self, batch, batch_idx):
            return self.model(**batch).loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    transport = CaptureTransport()
    trainer = pl.Trainer(max_steps=2, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[callbacks.Fp8monCallback(transport=transport)])
    trainer.fit(Tiny(), DataLoader(token_examples(4), batch_size=BATCH))
    assert sorted(sent_rows(transport)) == [0, 1] and transport.meta[-1] == {"status": "finished"}
