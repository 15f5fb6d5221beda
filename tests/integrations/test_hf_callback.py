"""The Hugging Face callback on real ``transformers.Trainer`` runs of a tiny Llama on the CPU: the agent's steps are
the optimizer steps numbered as the Trainer's ``global_step`` (1..N), with the micro-batches of gradient accumulation
inside their step, the Trainer's logged loss/lr/grad_norm attached to the step they belong to, and the run closed."""

import importlib
import json
import logging
import math
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from transformers import Trainer, TrainerCallback, TrainingArguments

from fp8mon.integrations.hf import Fp8monCallback
from tests.agent.capture import CaptureTransport
from tests.integrations.tiny import HIDDEN, SEQ, all_rows, sent_rows, sent_scalars, tiny_llama, token_examples

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.sqlite_only]

ROOT = Path(__file__).resolve().parents[2]

BATCH, ACCUMULATE, STEPS = 2, 2, 6
ROWS = all_rows()


class GradsBeforeTheOptimizer(TrainerCallback):
    """lm_head's accumulated gradient as the optimizer of each step (numbered as the agent numbers it) sees it."""

    def __init__(self):
        self.grads = {}

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grads[state.global_step + 1] = model.lm_head.weight.grad.detach().clone()


def train(tmp_path, callback, *extra, logging_steps=1, eval_dataset=None, compute_metrics=None, **args):
    arguments = TrainingArguments(
        output_dir=str(tmp_path / "llama-tiny-hf"), max_steps=STEPS, per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=ACCUMULATE, logging_steps=logging_steps, learning_rate=1e-3,
        lr_scheduler_type="linear", report_to="none", save_strategy="no", use_cpu=True, disable_tqdm=True,
        dataloader_num_workers=0, **args)
    trainer = Trainer(model=tiny_llama(), args=arguments, train_dataset=token_examples(BATCH * ACCUMULATE * STEPS),
                      eval_dataset=eval_dataset, compute_metrics=compute_metrics, callbacks=[callback, *extra])
    trainer.train()
    return trainer


def test_steps_are_the_optimizer_steps_and_carry_their_micro_batches_and_logged_scalars(tmp_path):
    transport, grads = CaptureTransport(), GradsBeforeTheOptimizer()
    callback = Fp8monCallback(transport=transport, every=1, hist=False)
    trainer = train(tmp_path, callback, grads, max_grad_norm=0.0)  # no clipping: the gradient the agent read

    agent = callback.agent
    assert agent.errors == 0, agent.last_error
    rows = sent_rows(transport)
    assert sorted(rows) == list(range(1, STEPS + 1)) == [h["step"] for h in trainer.state.log_history if "loss" in h]
    for step, by_key in rows.items():
        assert set(by_key) == ROWS, f"step {step}: missing {sorted(ROWS - set(by_key))[:3]}"
        # both micro-batches of the step, no more: tokens x hidden of ACCUMULATE batches
        assert by_key[("model.layers.0.self_attn.q_proj", "input")]["numel"] == ACCUMULATE * BATCH * SEQ * HIDDEN
        # the accumulated gradient of this step's optimizer update
        assert math.isclose(by_key[("lm_head", "grad_weight")]["rms"], grads.grads[step].square().mean().sqrt(),
                            rel_tol=1e-5)

    scalars = sent_scalars(transport)
    for logged in trainer.state.log_history:
        if "loss" in logged:
            got = scalars[logged["step"]]
            assert got["loss"] == pytest.approx(logged["loss"]), logged
            assert got["lr"] == pytest.approx(logged["learning_rate"]), logged
            assert got["grad_norm"] == pytest.approx(logged["grad_norm"]), logged
    assert scalars[1]["lr"] > scalars[STEPS]["lr"]  # the linear schedule: each step's own learning rate
    assert "train_runtime" in scalars[STEPS]  # the end-of-training log, at the last step

    meta = {k: v for m in transport.meta for k, v in m.items()}
    assert meta["status"] == "finished" and transport.meta[-1] == {"status": "finished"}
    assert meta["tags"]["framework"] == "transformers"
    assert meta["config"]["gradient_accumulation_steps"] == ACCUMULATE and meta["config"]["max_steps"] == STEPS


def token_accuracy(prediction) -> dict:
    hits = prediction.predictions.argmax(-1)[:, :-1] == prediction.label_ids[:, 1:]
    return {"token accuracy": float(hits.mean())}  # a name the monitor does not take as it is


def test_every_2_sends_statistics_on_even_steps_only_and_evaluation_stays_out(tmp_path):
    transport = CaptureTransport()
    callback = Fp8monCallback(transport=transport, every=2, hist=False)
    # evaluated after step 3, right before the reporting step 4: in eval mode, which the statistics do not see
    train(tmp_path, callback, logging_steps=2, eval_strategy="steps", eval_steps=3, eval_dataset=token_examples(4),
          compute_metrics=token_accuracy)

    assert callback.agent.errors == 0, callback.agent.last_error
    rows = sent_rows(transport)
    assert sorted(rows) == [2, 4, 6]
    assert all(set(by_key) == ROWS for by_key in rows.values())
    assert all(r[("lm_head", "input")]["numel"] == ACCUMULATE * BATCH * SEQ * HIDDEN for r in rows.values())
    scalars = sent_scalars(transport)
    assert sorted(s for s, v in scalars.items() if "loss" in v) == [2, 4, 6]
    assert 0 <= scalars[3]["eval_token_accuracy"] <= 1 and "eval_loss" in scalars[6]


def test_end_to_end_a_live_monitor_shows_the_run_under_its_output_dir_name(live_server, tmp_path):
    callback = Fp8monCallback(url=live_server.url, every=2, spool_dir=tmp_path / "spool", flush_interval=0.05)
    trainer = train(tmp_path, callback)  # no run name: the basename of output_dir
    assert callback.agent.errors == 0, callback.agent.last_error

    api = f"{live_server.url}/api/v1/runs/llama-tiny-hf"
    run = httpx.get(api).json()
    assert run["status"] == "finished" and run["tags"] == {"framework": "transformers"}
    config = run["config"]
    assert config["gradient_accumulation_steps"] == ACCUMULATE and config["per_device_train_batch_size"] == BATCH
    catalogue = httpx.get(f"{api}/catalogue").json()
    assert {(layer["layer"], site) for layer in catalogue["layers"] for site in layer["sites"]} == ROWS
    loss = httpx.get(f"{api}/series", params={"scalar": "loss"}).json()["points"]
    assert loss["step"] == list(range(1, STEPS + 1))
    assert loss["value"] == pytest.approx([h["loss"] for h in trainer.state.log_history if "loss" in h])
    amax = httpx.get(f"{api}/series", params={"stat": "amax", "layer": "lm_head", "site": "grad_output"}).json()
    assert amax["points"]["step"] == [2, 4, 6]


FAILING_RUN = """
import atexit, json, sys
from transformers import Trainer, TrainerCallback, TrainingArguments
from fp8mon.integrations.hf import Fp8monCallback
from tests.agent.capture import CaptureTransport
from tests.integrations.tiny import sent_scalars, tiny_llama, token_examples

class Diverge(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 3:
            raise FloatingPointError("loss is NaN")

transport = CaptureTransport()
# exit handlers run last-registered first: this one after the callback's
atexit.register(lambda: print(json.dumps({"meta": transport.meta, "loss_steps": sorted(
    s for s, v in sent_scalars(transport).items() if "loss" in v)})))
args = TrainingArguments(output_dir=sys.argv[1], max_steps=6, per_device_train_batch_size=2, logging_steps=1,
                         report_to="none", save_strategy="no", use_cpu=True, disable_tqdm=True)
callback = Fp8monCallback(transport=transport, every=1, hist=False)
Trainer(model=tiny_llama(), args=args, train_dataset=token_examples(12), callbacks=[callback, Diverge()]).train()
"""


def test_a_run_that_an_exception_ends_is_closed_as_failed(tmp_path):
    # the Trainer tells its callbacks of no exception: the callback closes the run at interpreter exit
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", FAILING_RUN, str(tmp_path)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env=env)
    assert done.returncode == 1 and "loss is NaN" in done.stderr, done.stderr[-2000:]
    sent = json.loads(done.stdout.strip().splitlines()[-1])
    assert sent["meta"][-1] == {"status": "failed"} and sent["loss_steps"] == [1, 2]


def test_a_missing_transformers_names_the_extra_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # as in an install without transformers
    monkeypatch.delitem(sys.modules, "fp8mon.integrations.hf")
    with pytest.raises(ImportError, match=r"pip install 'fp8mon\[hf\]'"):
        importlib.import_module("fp8mon.integrations.hf")


def test_a_model_with_nothing_to_watch_is_told_not_counted(tmp_path, caplog):
    transport = CaptureTransport()
    callback = Fp8monCallback(transport=transport, modules=r"^no_such_layer")
    with caplog.at_level(logging.WARNING, logger="fp8mon.agent"):
        train(tmp_path, callback)
    assert "matched none of the model's 15 nn.Linear layers" in caplog.text
    assert callback.agent.errors == 0 and sent_rows(transport) == {}
    assert transport.meta[-1] == {"status": "finished"}


def test_bad_arguments_fail_before_training(tmp_path):
    with pytest.raises(TypeError, match="not both"):
        Fp8monCallback(agent=object(), every=2)
    with pytest.raises(ValueError, match="every must be >= 1"):
        train(tmp_path, Fp8monCallback(transport=CaptureTransport(), every=0))

