"""The Agent on real training loops: records against the oracle (agent/stats/reference.py) computed on the same
tensors, end to end through a real `fp8mon serve`, and no host synchronisation in the training step."""

import logging
import math
from collections import defaultdict

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from fp8mon.agent import Agent
from fp8mon.agent.batching import MAX_ITEMS
from fp8mon.agent.formats import by_name, delayed_scale
from fp8mon.agent.stats import torch_path as ds
from fp8mon.agent.stats.reference import Moments, merge_moments
from fp8mon.agent.wire import LOG2_HIST_LO, SITES, TENSOR_STATS
from tests.agent.capture import CaptureTransport, rows_counting

FORMATS = {"input": "e4m3", "weight": "e4m3", "output": None, "grad_output": "e5m2", "grad_weight": "e5m2"}
EXACT = ("numel", "nonfinite", "amax", "zero_frac", "outlier_frac", "underflow_frac", "overflow_frac", "scale",
         "amax_history_max")


pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ---- a tiny transformer LM ----------------------------------------------------------------------

class Attention(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn, self.mlp = Attention(d, heads), MLP(d)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    def __init__(self, vocab=32, d=16, layers=2, heads=2):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens):
        x = self.emb(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


BLOCK_LINEARS = [f"blocks.{i}.{n}" for i in range(2) for n in ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")]


def batches(n, seed=0, batch=4, seq=8, vocab=32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (batch, seq + 1), generator=g) for _ in range(n)]


def lm_loss(model, tokens):
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


# ---- helpers ------------------------------------------------------------------------------------

class Reference:
    """Clones of what each watched layer saw, per step and site, to compute the oracle's statistics."""

    def __init__(self, model, names):
        self.step = 0
        self.seen = defaultdict(list)  # (step, layer, site) -> tensors, in call order
        modules = dict(model.named_modules())
        for name in names:
            mod = modules[name]
            mod.register_forward_hook(self._forward(name))
            mod.weight.register_post_accumulate_grad_hook(self._grad_weight(name))

    def _forward(self, name):
        def hook(mod, args, out):
            key = (self.step, name)
            self.seen[(*key, "input")].append(args[0].detach().clone())
            self.seen[(*key, "output")].append(out.detach().clone())
            self.seen[(*key, "weight")].append(mod.weight.detach().clone())
            out.register_hook(lambda g: self.seen[(*key, "grad_output")].append(g.detach().clone()))
        return hook

    def _grad_weight(self, name):
        def hook(p):
            self.seen[(self.step, name, "grad_weight")].append(p.grad.detach().clone())
        return hook

    def expected(self, step, layer, site, fmt="default", **kw) -> dict:
        tensors = self.seen[(step, layer, site)]
        assert tensors, (step, layer, site)
        fmt = FORMATS[site] if fmt == "default" else fmt
        if site == "weight":
            tensors = tensors[:1]  # read once per step
        if site == "grad_weight":
            tensors = tensors[-1:]  # the accumulated gradient the optimizer sees
        stats = merge_moments(Moments.from_tensor(t, fmt=fmt, **kw) for t in tensors).to_stats()
        return stats


def assert_record(got: dict, want: dict, rtol=1e-9):
    for key in TENSOR_STATS:
        g, w = got[key], want[key]
        if w is None or g is None:
            assert g is None and w is None, (key, g, w)
        elif isinstance(w, float) and math.isnan(w):
            assert math.isnan(g), (key, g)
        elif key in EXACT:
            assert g == w, (key, g, w)
        else:
            # a mean near zero is a cancellation: its error scales with the values (rms), not with itself
            atol = rtol * want["rms"] if key == "mean" else 0.0
            assert math.isclose(g, w, rel_tol=rtol, abs_tol=atol), (key, g, w)
    assert got["log2_hist"] == want["log2_hist"]


def train(model, agent, data, *, ref=None, micro=1, opt=None, lr=0.05):
    opt = opt or torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for step, tokens in enumerate(data):
        if ref is not None:
            ref.step = step
        for chunk in tokens.chunk(micro):
            loss = lm_loss(model, chunk) / micro
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        if agent is not None:
            agent.log(step, loss=loss, lr=lr)
    return losses


# ---- end to end ---------------------------------------------------------------------------------

def stored_records(database_url):
    from sqlalchemy import text  # the monitor's deps: only this test needs them

    from fp8mon.monitor.storage import SqlAlchemyStore as Store

    store = Store(database_url)
    try:
        with store.engine.connect() as conn:
            cols = ", ".join(f"t.{c}" for c in TENSOR_STATS)
            rows = conn.execute(text(f"select t.step, s.layer, s.site, t.rank, {cols}, t.log2_hist "
                                     "from tensor_stats t join tensor_series s on s.id = t.series_id")).all()
            scalars = conn.execute(text("select t.step, s.name, t.value from scalars t "
                                        "join scalar_series s on s.id = t.series_id")).all()
            values = conn.execute(text("select coalesce(sum(n_values), 0), count(*) from ingest_batches")).one()
    finally:
        store.close()
    records = {}
    for row in rows:
        step, layer, site, rank, *stats, hist = row
        rec = {name: None if v is None else float(v) for name, v in zip(TENSOR_STATS, stats)}
        rec["log2_hist"] = None if hist is None else np.frombuffer(hist, dtype="<i8").tolist()
        records[(step, layer, site, rank)] = rec
    return records, {(s, n): float(v) for s, n, v in scalars}, values


def test_end_to_end_training_every_record_arrives_once_and_equals_the_oracle(live_server, tmp_path):
    torch.manual_seed(0)
    model = TinyLM()
    ref = Reference(model, BLOCK_LINEARS)
    agent = Agent(live_server.url, hist_every=1, run="e2e-tiny-lm", every=2, modules=r"^blocks\.",
                  spool_dir=tmp_path / "spool", flush_interval=0.05)
    agent.watch(model)
    losses = train(model, agent, batches(20), ref=ref)
    assert agent.close(timeout=30)
    assert agent.errors == 0, agent.last_error

    records, scalars, (n_values, n_batches) = stored_records(live_server.database_url)
    expected_keys = {(s, layer, site, 0) for s in range(0, 20, 2) for layer in BLOCK_LINEARS for site in SITES}
    assert set(records) == expected_keys  # every reporting step, layer and site; no head, no odd step
    for (step, layer, site, _), rec in records.items():
        assert_record(rec, ref.expected(step, layer, site))
    assert scalars == {**{(s, "loss"): float(losses[s]) for s in range(20)}, **{(s, "lr"): 0.05 for s in range(20)}}
    # exactly once: the server counted every value it stored once per batch it accepted
    sent_values = sum(v is not None for rec in records.values() for k, v in rec.items() if k != "log2_hist")
    assert n_values == sent_values + len(scalars) and n_batches >= 1


# ---- behaviour on a capture transport -----------------------------------------------------------

def test_gradient_accumulation_merges_micro_batches_and_reports_the_accumulated_gradient():
    torch.manual_seed(1)
    model = TinyLM()
    ref = Reference(model, BLOCK_LINEARS)
    cap = CaptureTransport()
    agent = Agent(transport=cap, hist_every=1, every=3, modules=r"^blocks\.").watch(model)
    train(model, agent, batches(7, seed=2, batch=6), ref=ref, micro=3)
    agent.close()
    records = cap.records()
    assert {k[0] for k in records} == {0, 3, 6} and agent.errors == 0
    for (step, layer, site, rank), rec in records.items():
        assert rank == 0
        want = ref.expected(step, layer, site)
        assert_record(rec, want)
        calls = 1 if site in ("weight", "grad_weight") else 3
        assert rec["numel"] == calls * ref.seen[(step, layer, site)][0].numel()
    assert len(ref.seen[(0, "blocks.0.mlp.fc1", "grad_weight")]) == 3  # the hook fired 3 times, last won


def test_modules_regex_sites_and_formats():
    torch.manual_seed(2)
    model = TinyLM()
    ref = Reference(model, ["blocks.0.mlp.fc1", "blocks.1.mlp.fc1", "head"])
    cap = CaptureTransport()
    agent = Agent(transport=cap, every=1, modules=r"mlp\.fc1$|^head$", sites=("output", "grad_output"),
                  formats={"output": "e4m3"}, outlier_k=3.0, hist=False).watch(model)
    train(model, agent, batches(2, seed=3), ref=ref)
    agent.close()
    records = cap.records()
    layers = ("blocks.0.mlp.fc1", "blocks.1.mlp.fc1", "head")
    assert {(k[1], k[2]) for k in records} == {(layer, site) for layer in layers for site in ("output", "grad_output")}
    for (step, layer, site, _), rec in records.items():
        want = ref.expected(step, layer, site, fmt="e4m3" if site == "output" else "e5m2", outlier_k=3.0, hist=False)
        assert rec["underflow_frac"] is not None and rec["log2_hist"] is None
        assert_record(rec, {**want, "log2_hist": None})
    with pytest.raises(ValueError, match="unknown sites"):
        Agent(transport=cap, sites=("input", "activations"))


class _DoublesItsInputInPlace(nn.Linear):
    def forward(self, x):
        return super().forward(x.mul_(2))


@pytest.mark.parametrize("sites", [("input",), ("input", "weight"), ("input", "output")])
def test_an_input_watched_without_its_output_is_read_before_the_layer_runs(sites):
    """Read before the layer (right after the kernel that wrote it, on a GPU), a layer's input is the tensor it was
    given; read with its output in one launch after the layer, it is as the layer left it. The weight goes with
    either."""
    torch.manual_seed(0)
    model = nn.Sequential(_DoublesItsInputInPlace(8, 8))
    cap = CaptureTransport()
    agent = Agent(transport=cap, every=1, sites=sites, hist=False).watch(model)
    x = torch.randn(16, 8)
    given = x.square().mean().sqrt().item()
    model(x).square().mean().backward()
    agent.log(0)
    agent.close()
    rec = next(r for k, r in cap.records().items() if k[1:3] == ("0", "input"))
    assert rec["rms"] == pytest.approx(2 * given if "output" in sites else given, rel=1e-6)
    if "weight" in sites:
        rec = next(r for k, r in cap.records().items() if k[1:3] == ("0", "weight"))
        assert rec["rms"] == pytest.approx(model[0].weight.detach().square().mean().sqrt().item(), rel=1e-6)


def test_hooks_exist_only_on_reporting_steps_and_eval_passes_are_ignored():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    cap = CaptureTransport()
    agent = Agent(transport=cap, every=3).watch(model)
    lin = model[0]
    counts = []
    for step in range(4):
        counts.append((len(lin._forward_hooks), len(lin.weight._post_accumulate_grad_hooks or {})))
        model.eval()
        with torch.no_grad():
            model(torch.randn(5, 4) * 100)  # validation: not training statistics
        model.train()
        model(torch.randn(3, 4)).sum().backward()
        agent.log(step)
    agent.close()
    assert counts == [(1, 1), (0, 0), (0, 0), (1, 1)]
    assert not lin._forward_hooks and not lin.weight._post_accumulate_grad_hooks
    assert {k[0] for k in cap.records()} == {0, 3}
    assert {rec["numel"] for rec in cap.records().values()} == {12, 16, 8, 6}  # batch 3; no eval batch of 5


def test_histogram_rides_on_every_hist_every_th_reporting_step_and_the_rest_is_unchanged():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    batches = [torch.randn(4, 6) for _ in range(9)]
    caps = []
    for hist_every in (3, 1):
        cap = CaptureTransport()
        agent = Agent(transport=cap, every=2, hist_every=hist_every).watch(model)
        for step, x in enumerate(batches):  # the torch statistics path: underflow exact without the histogram
            model(x).sum().backward()  # no optimizer: both agents see the same tensors
            agent.log(step)
            model.zero_grad()
        agent.close()
        caps.append(cap.records())
    sparse, full = caps
    assert sparse.keys() == full.keys() and {k[0] for k in sparse} == {0, 2, 4, 6, 8}
    with_hist = {k[0] for k, rec in sparse.items() if rec["log2_hist"] is not None}
    assert with_hist == {0, 6}  # every 3rd reporting step of every=2
    for key, rec in sparse.items():
        want = full[key]
        assert want["log2_hist"] is not None
        for name, value in rec.items():
            if name == "log2_hist" and key[0] not in with_hist:
                continue
            assert value == want[name] or (value != value and want[name] != want[name]), (key, name)
    with pytest.raises(ValueError, match="hist_every"):
        Agent(transport=CaptureTransport(), hist_every=0)


def test_step_api_late_gradients_and_scalars():
    model = nn.Sequential(nn.Linear(4, 4))
    cap = CaptureTransport()
    agent = Agent(transport=cap, every=10).watch(model)
    assert agent.current_step == 0 and agent.reporting
    agent.step(20)  # resuming: step 20 runs next, and it reports
    assert agent.reporting
    out = model(torch.randn(2, 4))
    agent.log(20, loss=torch.tensor(1.5, requires_grad=True), **{"bad name!": 1.0, "tokens_per_s": 9.0})
    out.sum().backward()  # after log(20): too late for step 20
    assert agent.current_step == 21 and not agent.reporting
    agent.log(19, lr=0.1)  # an older step: scalars only
    assert agent.current_step == 21
    agent.close()
    records = cap.records()
    assert {(k[0], k[2]) for k in records} == {(20, "input"), (20, "weight"), (20, "output")}
    scalars = {(b["step"], n): v for b in cap.scalars for n, v in zip(b["name"], b["value"])}
    assert scalars == {(20, "loss"): 1.5, (20, "tokens_per_s"): 9.0, (19, "lr"): 0.1}
    assert agent.errors == 2 and "arrived after log()" in agent.last_error  # bad name, late gradient


def test_delayed_scaling_keeps_an_amax_history_and_reports_overflow():
    torch.manual_seed(3)
    lin = nn.Linear(8, 8)
    cap = CaptureTransport()
    agent = Agent(transport=cap, hist_every=1, every=2, sites=("input",), scaling="delayed", amax_history_len=3,
                  margin=1).watch(lin)
    xs, amaxes = [], []
    for step in range(9):
        x = torch.randn(16, 8) * 4.0**step
        x[0, 0] = math.nan  # non-finite elements stay out of the amax
        if step % 2 == 0:
            xs.append(x)
        lin(x).sum().backward()
        amaxes.append(float(x.nan_to_num(0).abs().max()))
        agent.log(step)
    agent.close()
    records = cap.records()
    assert sorted(k[0] for k in records) == [0, 2, 4, 6, 8]
    overflowed = 0
    for i, step in enumerate(range(0, 9, 2)):
        window = amaxes[max(0, step - 3):step] or [0.0]  # the previous <= 3 steps, every step counted
        scale = delayed_scale(window, "e4m3", margin=1)
        want = Moments.from_tensor(xs[i], fmt="e4m3", scale=scale, amax_history_max=max(window)).to_stats()
        assert_record(records[(step, "Linear", "input", 0)], want)
        overflowed += want["overflow_frac"] > 0
    assert overflowed >= 3  # the stale history (amax x4 per step, margin 1) does overflow


def test_caller_given_scale_and_self_reporting_layer():
    class FP8Linear(nn.Module):
        """Stands in for the trainer's FP8 linear: it reports its input statistics itself."""

        fp8mon_linear = True
        fp8mon_reported_sites = ("input",)

        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(4, 6) * 0.1)
            self.x_scale = torch.tensor(64.0)
            self.agent = None

        def forward(self, x):
            if self.agent is not None and self.agent.reporting:  # the fused kernel's statistics
                self.agent.report("fp8", "input", ds.partials(x, fmt="e4m3", scale=self.x_scale))
            return F.linear(x, self.weight)

    torch.manual_seed(4)
    model = nn.Sequential()
    model.add_module("fp8", FP8Linear())
    model.add_module("plain", nn.Linear(4, 4))
    cap = CaptureTransport()
    agent = Agent(transport=cap, hist_every=1, every=1, sites=("input", "weight", "grad_output")).watch(model)
    model.fp8.agent = agent
    w_scale = torch.tensor(1024.0)
    history = torch.tensor([0.5, 2.0, 1.0])
    agent.set_scale("fp8", "weight", w_scale, amax_history=history)
    agent.set_scale("plain", "input", lambda: model.fp8.x_scale * 2)
    inputs = []
    for step in range(2):
        x = torch.randn(5, 6)
        inputs.append((x, F.linear(x, model.fp8.weight).detach()))
        model(x).sum().backward()
        agent.log(step)
        w_scale.mul_(2)  # the layer updates its scales in place
        model.fp8.x_scale.mul_(0.5)
    agent.close()
    rec = cap.records()
    assert agent.errors == 0, agent.last_error
    for step, (x, h) in enumerate(inputs):
        xs = 64.0 * 0.5**step
        assert_record(rec[(step, "fp8", "input", 0)], Moments.from_tensor(x, fmt="e4m3", scale=xs).to_stats())
        assert rec[(step, "fp8", "input", 0)]["numel"] == x.numel()  # not read a second time by a hook
        w = rec[(step, "fp8", "weight", 0)]
        assert w["scale"] == 1024.0 * 2**step and w["amax_history_max"] == 2.0
        assert_record(rec[(step, "plain", "input", 0)], Moments.from_tensor(h, fmt="e4m3", scale=2 * xs).to_stats())
        assert (step, "fp8", "grad_output", 0) in rec and (step, "plain", "weight", 0) in rec


def test_errors_in_hooks_never_reach_the_training_loop(monkeypatch, caplog):
    model = TinyLM()
    cap = CaptureTransport()
    agent = Agent(transport=cap, hist_every=1, every=1, modules=r"mlp").watch(model)

    def broken(*args, **kwargs):
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr(ds, "partials", broken)
    with caplog.at_level(logging.ERROR, logger="fp8mon.agent"):
        losses = train(model, agent, batches(3, seed=5))
    agent.close()
    assert all(torch.isfinite(loss) for loss in losses)
    assert agent.errors == 3 * 4 * 5  # steps x layers x sites, every one counted
    assert len([r for r in caplog.records if "kernel exploded" in r.getMessage()]) == 5  # once per site
    assert cap.tensors == [] and len(cap.scalars) == 3  # the scalars still arrive


def _tiny_lm_watched_every_step(seed: int):
    """A seeded TinyLM, its oracle, and an agent capturing every block linear's sites at every step."""
    torch.manual_seed(seed)
    model = TinyLM()
    ref = Reference(model, BLOCK_LINEARS)
    cap = CaptureTransport()
    return model, ref, cap, Agent(transport=cap, hist_every=1, every=1, modules=r"^blocks\.").watch(model)


def test_auto_backend_falls_back_to_torch_when_the_triton_statistics_fail(monkeypatch):
    """stats_backend="auto": a Triton statistics launch that fails (say, a kernel that does not compile on
    this GPU) is one counted error, and that step's rows and all later ones come from the torch path."""
    from fp8mon.agent.stats import launch as ts

    model, ref, cap, agent = _tiny_lm_watched_every_step(seed=3)
    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("no kernel image for this GPU")

    monkeypatch.setattr(ts, "rows", broken)
    monkeypatch.setattr(agent._sink, "_triton_for", lambda x: agent.stats_backend == "auto")  # as on a GPU
    train(model, agent, batches(3, seed=4), ref=ref)
    agent.close()
    assert len(calls) == 1 and agent.errors == 1 and "torch path" in agent.last_error
    records = cap.records()
    assert {k[0] for k in records} == {0, 1, 2}
    for (step, layer, site, rank), rec in records.items():
        assert_record(rec, ref.expected(step, layer, site))


def test_a_layers_backward_sites_share_one_launch_and_a_frozen_weight_loses_no_grad_output(monkeypatch):
    """On the Triton path a watched layer's grad_output waits for its grad_weight (the same backward node
    produces it next) and the step's tensors share launches. A weight
    frozen after watch() sends no grad_weight; its layer's waiting grad_output is then observed alone, in
    its own step."""
    from fp8mon.agent.stats import launch as ts

    model, ref, cap, agent = _tiny_lm_watched_every_step(seed=5)
    launches = []
    monkeypatch.setattr(ts, "rows", rows_counting(launches))
    monkeypatch.setattr(agent._sink, "_triton_for", lambda x: True)  # as on a GPU
    frozen = "blocks.1.mlp.fc2"
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step, tokens in enumerate(batches(4, seed=6)):
        if step == 2:
            dict(model.named_modules())[frozen].weight.requires_grad_(False)
        ref.step = step
        lm_loss(model, tokens).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        agent.log(step)
        if step == 0:  # the step's 40 tensors share launches (agent/batching.py)
            assert sum(launches) == 8 * 5 and len(launches) == -(-40 // MAX_ITEMS)
    ref.step = 4
    lm_loss(model, batches(1, seed=8)[0]).backward()
    agent.close()  # no log(): what the hooks saw is sent as step 4, the last grad_output that waited too
    assert agent.errors == 0
    records = cap.records()
    assert (4, frozen, "grad_output", 0) in records and (4, "blocks.0.attn.qkv", "grad_output", 0) in records
    for (step, layer, site, rank), rec in records.items():
        want = ref.expected(step, layer, site)
        assert rec["numel"] == want["numel"], (step, layer, site)
        assert math.isclose(rec["rms"], want["rms"], rel_tol=1e-9), (step, layer, site)
    for step in (2, 3, 4):
        assert (step, frozen, "grad_output", 0) in records and (step, frozen, "grad_weight", 0) not in records
    assert sum(site == "grad_output" for (_, _, site, _) in records) == 5 * 8


def test_a_steps_weights_are_read_in_the_first_forwards_launch_even_of_a_layer_that_does_not_run(monkeypatch):
    """The first hooked forward that reads a weight reads every due watched weight in the same launch, a layer whose
    forward did not run that step included (its weight's row is still that step's), and a layer in eval mode is left
    out."""
    from fp8mon.agent.stats import launch as ts
    from fp8mon.agent.stats import torch_path as ds

    torch.manual_seed(2)
    model = torch.nn.ModuleDict({n: torch.nn.Linear(8, 8) for n in ("a", "b", "skipped", "frozen_eval")})
    model["frozen_eval"].eval()
    cap = CaptureTransport()
    agent = Agent(transport=cap, every=1, sites=("weight",)).watch(model)
    launches = []
    monkeypatch.setattr(ts, "rows", rows_counting(launches))
    monkeypatch.setattr(agent._sink, "_triton_for", lambda x: True)
    x = torch.randn(4, 8)
    model["b"](model["a"](x))  # "skipped" and "frozen_eval" do not run
    agent.log(0)
    agent.close()
    rec = cap.records()
    layers = sorted(layer for (_, layer, site, _) in rec if site == "weight")
    assert launches == [3] and layers == ["a", "b", "skipped"]
    w = model["skipped"].weight.detach()
    rms = float(w.double().pow(2).mean().sqrt())
    assert math.isclose(rec[(0, "skipped", "weight", 0)]["rms"], rms, rel_tol=1e-9)
    assert ds.partials(w)[ds.NUMEL] == rec[(0, "skipped", "weight", 0)]["numel"]


def test_grad_weights_of_a_backward_pass_are_one_launch_and_the_last_pass_wins(monkeypatch):
    """Only grad_weight watched (an FP8 model's other sites come from its fused kernels): each backward pass
    observes every layer's .grad in one launch at its end (outside a pass, at the step's end), and with two micro-batches the
    step's row is the summed gradient the optimizer sees."""
    from fp8mon.agent.stats import launch as ts

    torch.manual_seed(7)
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)])
    cap = CaptureTransport()
    agent = Agent(transport=cap, every=1, sites=("grad_weight",)).watch(model)
    launches = []
    monkeypatch.setattr(ts, "rows", rows_counting(launches))
    monkeypatch.setattr(agent._sink, "_triton_for", lambda x: True)  # as on a GPU
    for _ in range(2):
        model(torch.randn(8, 16)).square().sum().backward()
    assert launches == [4, 4]
    agent._sink.observe_after_backward("0", "grad_weight", model[0].weight)  # outside a backward pass: at the end
    grads = {str(i): m.weight.grad.double() for i, m in enumerate(model)}
    agent.log(0)
    assert launches == [4, 4, 1]
    agent.close()
    records = cap.records()
    assert agent.errors == 0 and {k[1] for k in records} == set(grads)
    for layer, g in grads.items():
        assert math.isclose(records[(0, layer, "grad_weight", 0)]["rms"], float(g.square().mean().sqrt()),
                            rel_tol=1e-12)


def test_close_sends_a_grad_output_still_waiting_for_its_grad_weight():
    """Only grad_output and grad_weight watched, the weight frozen after watch(): at close() the grad_output
    still waits for a grad_weight that never comes, and nothing else was observed; it is sent, not lost."""
    torch.manual_seed(6)
    model = nn.Sequential(nn.Linear(8, 4))
    cap = CaptureTransport()
    agent = Agent(transport=cap, hist_every=1, every=1, sites=("grad_output", "grad_weight")).watch(model)
    model[0].weight.requires_grad_(False)
    model[0].bias.requires_grad_(False)
    model(torch.randn(5, 8, requires_grad=True)).square().sum().backward()
    agent.close()
    records = cap.records()
    assert agent.errors == 0 and list(records) == [(0, "0", "grad_output", 0)]
    assert records[(0, "0", "grad_output", 0)]["numel"] == 5 * 4


def test_context_manager_sets_the_run_status():
    cap = CaptureTransport()
    with Agent(transport=cap, config={"lr": 0.1}, tags={"arch": "llama"}) as agent:
        agent.log(0, loss=1.0)
    assert cap.meta == [{"config": {"lr": 0.1}, "tags": {"arch": "llama"}}, {"status": "finished"}]
    cap = CaptureTransport()
    with pytest.raises(KeyError):
        with Agent(transport=cap):
            raise KeyError("boom")
    assert cap.meta == [{"status": "failed"}]


def test_agent_import_is_lazy_and_needs_a_url_and_run(monkeypatch):
    import subprocess
    import sys

    code = "import sys, agent.wire; assert 'torch' not in sys.modules"  # the monitor imports agent.wire
    subprocess.run([sys.executable, "-c", code], check=True)
    monkeypatch.delenv("FP8MON_URL", raising=False)
    with pytest.raises(ValueError, match="url"):
        Agent(run="x")
    with pytest.raises(ValueError, match="run name"):
        Agent("http://127.0.0.1:9", run="bad run name")


# ---- no host synchronisation ------------------------------------------------------------------

SYNC_OPS = ("_local_scalar_dense", "nonzero", "masked_select", "unique", "bincount", "is_nonzero", "equal",
            "repeat_interleave",
            "lift_fresh")


class SyncRecorder(TorchDispatchMode):
    """Counts the aten ops on this thread that make a CUDA host wait (values read, data-dependent shapes)."""

    def __init__(self):
        super().__init__()
        self.ops, self.syncs = 0, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        name = func.name()
        bool_index = name.startswith("aten::index") and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool
            for a in args if isinstance(a, (list, tuple)) for i in a)
        if bool_index or any(s in name for s in SYNC_OPS):
            self.syncs.append(name)
        return func(*args, **(kwargs or {}))


def test_training_step_with_the_agent_adds_no_host_sync_on_cpu():
    """By design on CPU: every op the training thread runs, hooks and log() included, is recorded; the
    agent adds hundreds of ops and not one that would wait for a device."""
    def run(with_agent):
        torch.manual_seed(6)
        model = TinyLM()
        cap = CaptureTransport()
        agent = Agent(transport=cap, hist_every=1, every=2, scaling="delayed").watch(model) if with_agent else None
        rec = SyncRecorder()
        with rec:
            train(model, agent, batches(4, seed=7))
        if agent is not None:
            agent.close()
            assert len(cap.records()) == 2 * 9 * 5 and agent.errors == 0
        return rec

    base, watched = run(False), run(True)
    assert watched.ops > base.ops + 1000
    assert watched.syncs == base.syncs


def _current_underflow_slack(rec: dict, fmt: str) -> float:
    """Error bound of the Triton path's underflow fraction under current scaling (agent/stats/launch.py): exact
    below the threshold's binade, that binade counted as a uniform fraction, so off by at most its share of the
    finite nonzero elements (underflow_frac's denominator, agent/stats/reference.py)."""
    b = math.floor(math.log2(by_name(fmt).underflow_threshold / rec["scale"])) - LOG2_HIST_LO
    hist = rec["log2_hist"]
    return (hist[b] if 0 <= b < len(hist) else 0) / max(sum(hist), 1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_training_step_with_the_agent_adds_no_host_sync_on_cuda():
    torch.manual_seed(8)
    dev = torch.device("cuda")
    model = TinyLM().to(dev)
    ref = Reference(model, BLOCK_LINEARS)
    cap = CaptureTransport()
    agent = Agent(transport=cap, hist_every=1, every=2, modules=r"^blocks\.").watch(model)
    # a second agent on the same model: delayed scaling's device history, a caller-given device scale
    cap2 = CaptureTransport()
    delayed = Agent(transport=cap2, hist_every=1, every=3, modules=r"mlp", scaling="delayed",
                    amax_history_len=4).watch(model)
    delayed.set_scale("blocks.0.mlp.fc1", "input", torch.tensor(8.0, device=dev))
    data = [t.to(dev) for t in batches(6, seed=9)]
    train(model, agent, data[:1], ref=ref)  # warm-up: allocations, pinned buffers, cuBLAS handles
    delayed.log(0)
    torch.cuda.synchronize()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step in range(1, 6):
            ref.step = step
            loss = lm_loss(model, data[step])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            agent.log(step, loss=loss)
            delayed.log(step, loss=loss)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert agent.flush(30)
    agent.close()
    delayed.close()
    assert agent.errors == 0 and delayed.errors == 0, (agent.last_error, delayed.last_error)
    delayed_records = cap2.records()
    assert {k[0] for k in delayed_records} == {0, 3} and len(delayed_records) == 2 * 4 * 5
    assert delayed_records[(3, "blocks.0.mlp.fc1", "input", 0)]["scale"] == 8.0
    assert delayed_records[(3, "blocks.1.mlp.fc2", "weight", 0)]["amax_history_max"] > 0
    records = cap.records()
    assert {k[0] for k in records} == {0, 2, 4} and len(records) == 3 * 8 * 5
    for (step, layer, site, _), rec in records.items():
        # outliers are counted against the previous reporting step's (mean, std) of the same layer and site, as
        # the agent sent them; none before one exists (the Triton path's documented center)
        prev = records.get((step - 2, layer, site, 0))
        center = (prev["mean"], prev["std"]) if prev else (math.nan, math.nan)
        want = ref.expected(step, layer, site, outlier_center=center)
        if FORMATS[site] is not None:  # current scaling: the Triton path estimates underflow from the histogram
            slack = _current_underflow_slack(rec, FORMATS[site])
            assert abs(rec["underflow_frac"] - want["underflow_frac"]) <= slack + 1e-12, (step, layer, site, slack)
            want["underflow_frac"] = rec["underflow_frac"]
        assert_record(rec, want, rtol=1e-7)
    assert {b["step"] for b in cap.scalars} == set(range(6))


def test_a_weight_replaced_after_watch_keeps_its_grad_weight_rows():
    """fully_shard, a reloaded checkpoint or a user's code may replace a layer's weight after watch(): the next step's
    hooks follow the new one."""
    torch.manual_seed(9)
    model = nn.Sequential(nn.Linear(4, 4))
    cap = CaptureTransport()
    agent = Agent(transport=cap, every=1, sites=("grad_weight",)).watch(model)
    for step in range(3):
        if step == 1:
            model[0].weight = nn.Parameter(model[0].weight.detach().clone())
        model(torch.randn(8, 4)).square().sum().backward()
        agent.log(step)
    agent.close()
    assert agent.errors == 0 and sorted(k[0] for k in cap.records()) == [0, 2]


@pytest.mark.parametrize("kwargs, message", [
    ({"run": "team/../other"}, "'..' part"),
    ({"tags": {"a=b": "c"}}, "invalid tag key"),
    ({"tags": {"model": "llama\x00"}}, "invalid tag value"),
    ({"config": {"weights": b"\x00\x01"}}, "config must be JSON"),
])
def test_run_metadata_the_monitor_would_refuse_is_a_clear_error_at_once(kwargs, message, tmp_path):
    """A refused batch would take the step's statistics with it: the agent refuses such metadata when it is made."""
    with pytest.raises(ValueError, match=message):
        Agent(**{"url": "http://127.0.0.1:9", "run": "ok", "spool_dir": tmp_path, **kwargs})


def test_non_finite_config_values_are_accepted():
    Agent(transport=CaptureTransport(), config={"clip": float("inf"), "beta": float("nan")}).close()
