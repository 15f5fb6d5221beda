"""Rows taken by the fused modules around the linears (trainer/fused.py, through trainer/reporting.py's protocol), on
the CPU in Triton's interpreter (the ``interpreted`` fixture): a block or model watched by an agent gets from them the
rows its hooks take without them (an agent with ``fused=False``, whose hooks read every site), no hook reads those
sites, no output is deferred to a statistics read, and where the kernels do not run the modules report the same rows
computed with torch."""

from __future__ import annotations

import pytest
import torch
from trainer_rows import agent_rows, hist_slack, row_problems

pytestmark = pytest.mark.usefixtures("interpreted")

TINY = dict(n_layer=1, d_model=32, n_head=2, d_ff=48, seq_len=8, vocab_size=64)


def _tiny():
    from fp8mon.trainer.config import get_config

    return get_config("tiny", **TINY)


def _tokens(i: int) -> torch.Tensor:
    return torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(i))


def _floats(i: int) -> torch.Tensor:
    return torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(100 + i)) * (1 + i)


def _rows(monkeypatch, make_block, seed: int, inputs, fused: bool = True, on_torch: bool = False, steps: int = 2):
    """``agent_rows`` of ``make_block()`` over ``steps`` steps of two micro-batches: ``fused`` False, an agent whose
    hooks read every site; ``on_torch``, as on a device without the kernels (the agent's statistics in torch too)."""
    from fp8mon.trainer import reporting

    with monkeypatch.context() as m:
        if on_torch:
            m.setattr(reporting, "triton_runs", lambda device: False)
        torch.manual_seed(seed)
        block = make_block()
        xs = [inputs(i) for i in range(2 * steps)]
        return agent_rows(block, lambda step, micro: xs[2 * step + micro], steps, fused=fused,
                          stats_backend="torch" if on_torch else "triton")


def _same_rows(got, want, wanted: list) -> list[str]:
    """Where ``got``'s rows differ from ``want``'s at the slots ``wanted``, every step."""
    (rows, keys), (ref, ref_keys) = got, want
    if sorted(keys) != sorted(ref_keys):
        return [f"slots {keys} vs {ref_keys}"]
    problems = []
    for key in wanted:
        for step in range(len(ref)):
            a, b = rows[step][keys.index(key)], ref[step][ref_keys.index(key)]
            p = row_problems(a, b, under_slack=hist_slack(b))  # current scaling's underflow: from the histogram
            if p:
                problems.append(f"step {step} {key}: {p}")
    return problems


def _assert_same_rows(got, want, wanted: list) -> None:
    problems = _same_rows(got, want, wanted)
    assert not problems, "; ".join(problems)


NAMES = ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")
# what the fused modules of a llama block of plain linears take: the pre-norms the inputs of qkv and fc1, RoPE qkv's
# output and its gradient, SwiGLU fc1's output and gradient and fc2's input, the adds proj's and fc2's outputs and
# gradients
TAKEN = {"attn.qkv": ("input", "output", "grad_output"), "attn.proj": ("output", "grad_output"),
         "mlp.fc1": ("input", "output", "grad_output"), "mlp.fc2": ("input", "output", "grad_output")}
LLAMA_SITES = [(f"blocks.0.{n}", s) for n, sites in TAKEN.items() for s in sites]


def _llama():
    from fp8mon.trainer.model import Transformer

    return Transformer(_tiny(), "llama", "fp32")


@pytest.fixture(scope="module")
def llama_hooks_rows(interpreted):
    """The hooks' rows of a one-block llama of plain linears (the reference of the fused modules' rows)."""
    with pytest.MonkeyPatch.context() as m:
        yield _rows(m, _llama, 6, _tokens, fused=False)


def test_the_hooks_read_none_of_the_sites_the_fused_modules_take():
    from trainer_rows import NullTransport

    from fp8mon.agent import Agent

    agent = Agent(transport=NullTransport(), every=1).watch(_llama())
    hooked = {h.name: set(h.sites) for h in agent._layers}
    agent.close()
    for name, sites in TAKEN.items():
        assert not hooked[f"blocks.0.{name}"] & set(sites), (name, hooked[f"blocks.0.{name}"])
        assert {"weight", "grad_weight"} <= hooked[f"blocks.0.{name}"]


def test_fused_modules_of_a_llama_take_the_rows_the_hooks_take(monkeypatch, llama_hooks_rows):
    _assert_same_rows(_rows(monkeypatch, _llama, 6, _tokens), llama_hooks_rows, LLAMA_SITES)


def test_without_the_kernels_the_modules_report_the_same_rows_computed_with_torch(monkeypatch):
    want = _rows(monkeypatch, _llama, 6, _tokens, fused=False, on_torch=True)
    _assert_same_rows(_rows(monkeypatch, _llama, 6, _tokens, on_torch=True), want, LLAMA_SITES)


def test_fused_rope_takes_the_qkv_outputs_rows_in_an_attention_of_its_own(monkeypatch):
    from fp8mon.trainer import layers

    rot = layers.Rotary(16, 16)

    class WithAttention(torch.nn.Module):  # agent_rows calls model(x)
        def __init__(self):
            super().__init__()
            self.attn = layers.Attention(32, 2, lambda i, o: torch.nn.Linear(i, o, bias=False), qk_norm=False)

        def forward(self, x):
            return self.attn(x, rot)

    want = _rows(monkeypatch, WithAttention, 5, _floats, fused=False)
    _assert_same_rows(_rows(monkeypatch, WithAttention, 5, _floats), want,
                      [("attn.qkv", s) for s in ("output", "grad_output")])


class _Autocast(torch.nn.Module):
    def __init__(self, arch: str = "llama"):
        super().__init__()
        from fp8mon.trainer.model import Transformer

        self.net = Transformer(_tiny(), arch, "bf16")

    def forward(self, idx):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.net(idx)


WEIGHT_SITES = [(f"net.blocks.0.{n}", s) for n in NAMES for s in ("weight", "grad_weight")]


@pytest.fixture(scope="module")
def bf16_hooks_rows(interpreted):
    with pytest.MonkeyPatch.context() as m:
        yield _rows(m, _Autocast, 9, _tokens, fused=False)


def test_bf16_weight_casts_take_the_weights_and_their_gradients_rows_in_one_launch_each(monkeypatch, bf16_hooks_rows):
    """A one-block bf16 llama under autocast: each linear's cast of its weight takes the weight's row and its cast
    back the gradient's, equal to the hooks' rows of the fp32 tensors; the first step registers the linears one by
    one, the second casts the four weights in one launch and their gradients back in one (the first micro-batch's: a
    later one's are added to them)."""
    from fp8mon.trainer.kernels import weight_casts

    batches, one_launch = [], weight_casts.casts_with_rows
    monkeypatch.setattr(weight_casts, "casts_with_rows",
                        lambda xs, *a: (batches.append((xs[0].dtype, len(xs))), one_launch(xs, *a))[1])
    _assert_same_rows(_rows(monkeypatch, _Autocast, 9, _tokens), bf16_hooks_rows, WEIGHT_SITES)
    forward = [n for dt, n in batches if dt == torch.float32]
    backward = [n for dt, n in batches if dt == torch.bfloat16]
    assert forward == backward == [1, 1, 1, 1, 4]


def test_without_the_kernels_bf16_linears_report_their_weights_rows_apart(monkeypatch):
    want = _rows(monkeypatch, _Autocast, 9, _tokens, fused=False, on_torch=True)
    _assert_same_rows(_rows(monkeypatch, _Autocast, 9, _tokens, on_torch=True), want, WEIGHT_SITES)


def _one_micro_batch_steps(monkeypatch, fused: bool, together: bool = True):
    """(rows, keys) an agent ships over two steps of one micro-batch of a bf16 llama under autocast, the block
    linears' weights read by their grad_weight hooks, and the (dtype, tensors) of each ``casts_with_rows`` launch;
    ``together``: the gradients cast back in one launch (``weight_rows.grads_together``), else each as it comes with
    the batch left to the weights of at most 2000 elements."""
    from trainer_rows import NullTransport

    from fp8mon.agent import Agent
    from fp8mon.trainer import weight_rows
    from fp8mon.trainer.kernels import weight_casts

    idx = [_tokens(i) for i in range(2)]
    batches, one_launch = [], weight_casts.casts_with_rows
    with monkeypatch.context() as m:
        m.setattr(weight_casts, "casts_with_rows",
                  lambda xs, *a: (batches.append((xs[0].dtype, len(xs))), one_launch(xs, *a))[1])
        m.setattr(weight_rows, "grads_together", lambda: together)
        if not together:
            m.setattr(weight_rows, "BATCH_MAX_ELEMENTS", 2000)
        torch.manual_seed(9)
        net = _Autocast()
        agent = Agent(transport=NullTransport(), every=1, hist_every=1, stats_backend="triton", fused=fused).watch(net)
        read, shipped = [], []
        real = agent._sink.observe_after_backward
        agent._sink.observe_after_backward = lambda layer, site, p: (read.append(layer), real(layer, site, p))
        agent._ship = lambda step, rows, values: shipped.append(rows.clone())
        for step in range(2):
            net.zero_grad(set_to_none=True)
            net(idx[step]).float().square().mean().backward()
            grads = [m_.weight.grad for n, m_ in net.named_modules() if n.endswith(NAMES)]
            norm, covered = agent.grad_sq_norms(grads)
            want = sum(float(g.double().square().sum()) for g in grads)
            if fused:  # clipping's norms, from the rows of the casts back
                assert all(covered) and abs(float(norm) - want) <= 1e-6 * want
            agent.log(step)
        keys = list(agent._slots.keys)
        agent.close()
    return (shipped, keys), sorted(set(r for r in read if r.startswith("net.blocks"))), batches


@pytest.fixture(scope="module")
def one_micro_batch_hooks(interpreted):
    with pytest.MonkeyPatch.context() as m:
        yield _one_micro_batch_steps(m, fused=False)


@pytest.mark.parametrize("together", [True, False])
def test_gradient_rows_from_the_casts_back_feed_clipping(monkeypatch, one_micro_batch_hooks, together):
    """One micro-batch a step: the casts back take the weights' gradient rows (no grad_weight hook reads one), equal to
    the hooks' rows without them, and clipping gets every block gradient's norm from them; with the gradients cast back
    together (one launch at the end of the backward pass), or each as it comes with the batch left to the weights of at
    most 2000 elements (proj's and fc2's: qkv and fc1 cast their own)."""
    want, read_plain, _ = one_micro_batch_hooks
    got, read_fused, batches = _one_micro_batch_steps(monkeypatch, fused=True, together=together)
    assert not read_fused and len(read_plain) == len(NAMES)
    seen = ([n for dt, n in batches if dt == torch.float32], [n for dt, n in batches if dt == torch.bfloat16])
    assert seen == (([1, 1, 1, 1, 4], [1, 1, 1, 1, 4]) if together else ([1, 1, 2], []))
    _assert_same_rows(got, want, [(f"net.blocks.0.{n}", "grad_weight") for n in NAMES])


def _fp8_triton(module: torch.nn.Module) -> torch.nn.Module:
    from fp8mon.trainer.fp8_linear import Fp8Linear

    for m in module.modules():
        if isinstance(m, Fp8Linear):
            m.backend = "triton"  # the Triton kernels, in the interpreter
    return module


def _deferred(monkeypatch) -> list:
    """The widths of the outputs deferred to a statistics read from now on, the FP8 linears taking their output rows
    the deferred way (as while a CUDA graph captures)."""
    from fp8mon.agent.stats import launch as ts
    from fp8mon.trainer import fp8_linear

    deferred, real = [], ts.defer
    monkeypatch.setattr(fp8_linear, "output_stats_mode", lambda: "deferred")
    monkeypatch.setattr(ts, "defer", lambda x, t: (deferred.append(x.shape[-1]), real(x, t))[1])
    return deferred


def test_swiglu_of_fp8_linears_takes_fc1s_output_row_which_is_not_deferred(monkeypatch):
    from fp8mon.trainer import layers
    from fp8mon.trainer.fp8_linear import Fp8Linear

    def block():
        return _fp8_triton(layers.SwiGLU(32, 48, lambda i, o: Fp8Linear(i, o)))

    hooks = _rows(monkeypatch, block, 7, _floats, fused=False)
    deferred = _deferred(monkeypatch)
    fused = _rows(monkeypatch, block, 7, _floats)
    assert deferred == [32] * 4  # 2 steps x 2 micro-batches: fc2's outputs only (fc1's: the SwiGLU kernel's)
    _assert_same_rows(fused, hooks, [("fc1", "output")])


def test_fp8_llama_outputs_come_from_the_fused_modules(monkeypatch):
    """A one-block FP8 llama: the rows of qkv's, proj's, fc1's and fc2's outputs come from the fused modules (none is
    deferred to a statistics read), once from each micro-batch, and equal the hooks' rows of those outputs."""
    from fp8mon.agent.stats import torch_path as ds
    from fp8mon.trainer.model import Transformer

    def net():
        return _fp8_triton(Transformer(_tiny(), "llama", "fp8"))

    hooks = _rows(monkeypatch, net, 3, _tokens, fused=False, steps=1)
    deferred = _deferred(monkeypatch)
    fused = _rows(monkeypatch, net, 3, _tokens, steps=1)
    assert not deferred
    outputs = [(f"blocks.0.{n}", "output") for n in NAMES]
    rows, keys = fused
    for key in outputs + [("blocks.0.attn.proj", "input")]:
        assert float(rows[0][keys.index(key)][ds.PARTS]) == 2, key
    _assert_same_rows(fused, hooks, outputs)
