"""Whole steps as CUDA graphs (trainer/graphs.py with Agent.capture / Agent.replayed): on a GPU a graphed run
equals the eager one, the agent's rows and histograms included; everywhere, the agent refuses replays it
cannot account for, and `fp8mon train --cuda-graph` refuses a CPU."""

import math

import pytest
import torch
from torch import nn

from fp8mon.agent import Agent
from fp8mon.agent.wire import SITES, TENSOR_STATS
from fp8mon.trainer.train import build_parser, run
from tests.agent.capture import CaptureTransport

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def mlp(width=16, depth=2) -> nn.Module:
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])


def sgd_step(model, opt, x):
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


# ---- the agent's side, on any device -----------------------------------------------------------------

def watched_mlp(every: int, hist_every: int):
    """A two-linear MLP, its optimizer, a batch and an agent (torch statistics) watching it."""
    torch.manual_seed(0)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    agent = Agent(transport=CaptureTransport(), every=every, hist_every=hist_every, stats_backend="torch")
    return model, opt, torch.randn(8, 16), agent.watch(model)


def test_a_capture_records_every_row_of_the_step_and_a_replay_must_be_of_its_kind():
    model, opt, x, agent = watched_mlp(every=2, hist_every=2)
    sgd_step(model, opt, x)  # eagerly first: the agent's buffers are allocated by a step's first rows
    agent.log(0)
    agent.log(1)
    with agent.capture() as record:  # on the CPU nothing is captured: the step runs, the record is what counts
        sgd_step(model, opt, x)
    assert (record.reporting, record.hist) == (True, False)
    assert len(record.written) == 2 * len(SITES)  # both linears, every site
    agent.log(2)
    with pytest.raises(ValueError, match="not the kind of step the graph captured"):
        agent.replayed(record)  # step 3 does not report
    with agent.capture() as idle:  # a step without statistics is captured too, and writes no row
        sgd_step(model, opt, x)
    assert not idle.reporting and not idle.written
    agent.log(3)
    with pytest.raises(ValueError, match=r"histogram=True\) is not the kind"):
        agent.replayed(record)  # step 4 reports with the histogram (every 2nd reporting step has it)
    agent.log(4)
    agent.log(5)
    agent.replayed(record)  # step 6: a reporting step without the histogram, as captured
    with pytest.raises(RuntimeError, match="already has rows"):
        with agent.capture():
            pass
    agent.close()


def test_a_replay_is_refused_once_the_agents_buffers_moved():
    model, opt, x, agent = watched_mlp(every=1, hist_every=1)
    sgd_step(model, opt, x)
    agent.log(0)
    with agent.capture() as record:
        sgd_step(model, opt, x)
    agent.log(1)
    agent.replayed(record)  # the same buffers: fine
    agent.log(2)
    more = mlp(depth=2)  # 10 more slots: the step buffer (16 rows) grows at its next write, to a new address
    agent.watch(more, prefix="more.")
    sgd_step(more, torch.optim.SGD(more.parameters(), lr=0.1), x)
    with pytest.raises(RuntimeError, match="moved since the graph was captured"):
        agent.replayed(record)
    agent.close()


def test_fp8mon_train_refuses_cuda_graphs_without_a_cuda_device():
    args = build_parser().parse_args(["--config", "tiny", "--device", "cpu", "--steps", "1", "--cuda-graph",
                                      "--no-progress"])
    with pytest.raises(SystemExit, match="--cuda-graph needs one CUDA device"):
        run(args)


# ---- graphs on the GPU ------------------------------------------------------------------------------

def _tiny_transformer_run(precision: str, graphed: bool, steps: int = 6):
    """Six AdamW steps of the trainer's tiny Llama with the agent at every step (histogram every 2nd): losses
    and records."""
    from fp8mon.trainer.config import get_config
    from fp8mon.trainer.fp8_linear import Fp8Recipe, cache_fp8_weights
    from fp8mon.trainer.graphs import StepGraphs, tensor_lr
    from fp8mon.trainer.model import Transformer, autocast

    dev = torch.device("cuda")
    cfg = get_config("tiny", vocab_size=256)
    torch.manual_seed(0)
    model = Transformer(cfg, "llama", precision, Fp8Recipe() if precision == "fp8" else None).to(dev)
    opt = torch.optim.AdamW(model.param_groups(0.1), lr=3e-3, fused=True)
    if precision == "fp8":
        cache_fp8_weights(model, opt)
    lr = tensor_lr(opt, dev)
    params = [p for p in model.parameters() if p.requires_grad]
    gen = torch.Generator(device=dev).manual_seed(1)
    data = torch.randint(0, 256, (steps, 2, 8, cfg.seq_len), device=dev, generator=gen)
    x, y = torch.empty_like(data[0, 0]), torch.empty_like(data[0, 1])

    def step():
        with autocast(precision, dev):
            loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    sink = CaptureTransport()
    agent = Agent(transport=sink, every=1, hist_every=2, modules=r"^blocks\.").watch(model)
    graphs = StepGraphs(step, agent=agent, warmup=1) if graphed else None
    losses = []
    for s in range(steps):
        x.copy_(data[s, 0])
        y.copy_(data[s, 1])
        lr.fill_(3e-3 * (s + 1) / steps)  # a schedule: the graph must read the rate of its step
        loss = graphs() if graphed else step()
        losses.append(loss.clone())
        agent.log(s, loss=loss)
    assert agent.close(timeout=60) and agent.errors == 0, agent.last_error
    return torch.stack(losses).tolist(), sink.records(), (graphs.captured if graphed else 0)


def _assert_close_records(got: dict, want: dict, rtol: float):
    assert got.keys() == want.keys()
    for key, w in want.items():
        g = got[key]
        for stat in TENSOR_STATS:
            a, b = g[stat], w[stat]
            if b is None or (isinstance(b, float) and math.isnan(b)):
                assert a is None or math.isnan(a), (key, stat, a, b)
            else:
                assert math.isclose(a, b, rel_tol=rtol, abs_tol=rtol * (w["rms"] or 1.0)), (key, stat, a, b)
        if w["log2_hist"] is None:
            assert g["log2_hist"] is None, key
        else:  # counts per binade: values on a binade's edge may land apart under reordered float sums
            assert sum(abs(p - q) for p, q in zip(g["log2_hist"], w["log2_hist"])) <= 1e-3 * w["numel"], key


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("precision", ["fp8", "bf16"])
def test_a_graphed_run_equals_the_eager_run_rows_and_histograms_included(precision, monkeypatch):
    from fp8mon.agent.stats import launch as ts
    from fp8mon.trainer.parts import Parts

    if precision == "fp8":  # torch's RoPE: qkv's output row is then the FP8 linear's own (deferred when captured)
        monkeypatch.setattr(Parts, "rope", lambda self, qkv, n_head, head_dim: None)
    deferred = []
    real_defer = ts.defer
    monkeypatch.setattr(ts, "defer", lambda x, t: (deferred.append(torch.cuda.is_current_stream_capturing()),
                                                   real_defer(x, t)))
    eager_losses, eager, _ = _tiny_transformer_run(precision, graphed=False)
    if precision == "fp8":
        assert not deferred  # eagerly the output rows come from the GEMM's epilogue
    else:
        assert deferred  # SwiGLU's words path leaves h's row (fc2's input) to the next statistics launch
    deferred.clear()
    graph_losses, graphed, captured = _tiny_transformer_run(precision, graphed=True)
    assert captured == 2  # the histogram steps and the others
    if precision == "fp8":  # captured, Fp8Linear's output rows join the next statistics launch instead
        assert deferred and all(deferred)
    assert graph_losses == pytest.approx(eager_losses, rel=1e-4)
    _assert_close_records(graphed, eager, rtol=1e-4)
    steps = {k[0] for k in eager}
    assert steps == set(range(6))
    # the check can tell replays apart: a replay that wrote nothing or left the captured step's rows would fail it
    moved = [k for k in eager if k[0] == 4 and not math.isclose(eager[k]["rms"], eager[(2, *k[1:])]["rms"],
                                                                  rel_tol=1e-3)]
    assert len(moved) > len(eager) // 12, "steps 2 and 4 too alike for the comparison to mean anything"
    assert all((graphed[k]["log2_hist"] is None) == (k[0] % 2 == 1) for k in graphed)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fp8mon_train_with_cuda_graphs_sends_what_the_eager_run_sends(monkeypatch):
    """Three kinds of step (reporting with and without the histogram, not reporting), two micro-batches, a
    schedule, the model's diagnostics: the graphed run's losses, statistics and scalars are the eager run's."""
    from fp8mon.agent import core

    sinks = []
    monkeypatch.setattr(core, "make_transport", lambda *a: sinks.append(CaptureTransport()) or sinks[-1])
    common = ["--config", "tiny", "--precision", "fp8", "--steps", "12", "--batch-size", "8", "--grad-accum", "2",
              "--device", "cuda", "--no-progress", "--log-every", "1", "--seed", "3", "--monitor-url",
              "http://127.0.0.1:9", "--monitor-every", "2", "--monitor-hist-every", "2", "--run-name", "graphs"]
    eager = run(build_parser().parse_args(common))
    graphed = run(build_parser().parse_args([*common, "--cuda-graph"]))
    assert graphed.status == eager.status == "finished"
    want = [eager.losses[s] for s in range(12)]
    assert [graphed.losses[s] for s in range(12)] == pytest.approx(want, rel=1e-4)
    assert want[-1] < want[0] - 0.5  # the schedule reached the graphs: they learned as the eager run did
    eager_rows, graph_rows = sinks[0].records(), sinks[1].records()
    assert {k[0] for k in eager_rows} == {0, 2, 4, 6, 8, 10}
    _assert_close_records(graph_rows, eager_rows, rtol=1e-3)
    assert all((rec["log2_hist"] is not None) == (k[0] % 4 == 0) for k, rec in graph_rows.items())
    scalars = [{(b["step"], n): v for b in sink.scalars for n, v in zip(b["name"], b["value"])
                if n != "tokens_per_s"} for sink in sinks]
    assert {k for k in scalars[1] if k[1] == "attn_max_logit"} == {(s, "attn_max_logit") for s in range(0, 12, 2)}
    assert scalars[1] == pytest.approx(scalars[0], rel=1e-3)


def test_the_output_row_is_taken_by_the_epilogue_unless_a_graph_captures(monkeypatch):
    from fp8mon.trainer import fp8_linear

    assert fp8_linear.output_stats_mode() == "epilogue"  # no capture here (the GPU test above runs "deferred")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert fp8_linear.output_stats_mode() == "deferred"


def test_tensor_lr_makes_one_rate_tensor_and_refuses_groups_with_different_rates():
    from fp8mon.trainer.graphs import tensor_lr

    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    opt = torch.optim.AdamW([{"params": a.parameters()}, {"params": b.parameters(), "weight_decay": 0.0}], lr=0.5)
    lr = tensor_lr(opt, torch.device("cpu"))
    assert all(g["lr"] is lr and g["capturable"] for g in opt.param_groups) and float(lr) == 0.5
    mixed = torch.optim.AdamW([{"params": a.parameters()}, {"params": b.parameters(), "lr": 0.1}], lr=0.5)
    with pytest.raises(ValueError, match="different learning rates"):
        tensor_lr(mixed, torch.device("cpu"))
