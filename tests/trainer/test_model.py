"""The trainer's model: every FOG-strong architectural property (SPEC section 5), the llama block, RoPE,
the named configs and the module names the monitor shows."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fp8mon.agent.hooks import select_modules
from fp8mon.trainer.config import CONFIGS, ModelConfig, get_config
from fp8mon.trainer.layers import XIELU, XIELUMLP, Attention, RMSNorm, Rotary, SwiGLU
from fp8mon.trainer.model import Transformer

SMALL = ModelConfig(n_layer=3, d_model=64, n_head=2, d_ff=96, seq_len=32)  # head_dim 32, FOG MLP 144


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def tokens(b=2, t=16, seed=0):
    return torch.randint(0, 256, (b, t), generator=torch.Generator().manual_seed(seed))


def capture(model, names):
    """Inputs and outputs of the named submodules during the next forward."""
    seen, handles = {}, []
    for name in names:
        module = model.get_submodule(name)

        def hook(mod, args, out, name=name):
            seen[name] = (args[0].detach().clone(), out.detach().clone() if torch.is_tensor(out) else None)

        handles.append(module.register_forward_hook(hook))
    return seen, handles


def rms_norm(x, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


# ---- FOG-strong ---------------------------------------------------------------------------------

def test_fog_attention_logits_are_bounded_by_an_eighth_of_head_dim_whatever_the_weights():
    torch.manual_seed(0)
    d, heads = 64, 2
    hd = d // heads
    bound = 0.125 * hd  # ||q^||, ||k^|| <= sqrt(hd) (per-head RMS <= 1, RoPE is a rotation) -> |q^.k^| <= hd
    attn = Attention(d, heads, lambda i, o: nn.Linear(i, o, bias=False), qk_norm=True, softmax_scale=0.125)
    rope = Rotary(hd, 64)
    x = 30 * torch.randn(2, 64, d)
    nn.init.normal_(attn.qkv.weight, std=10.0)  # huge weights: llama logits would be in the thousands
    q, k, _ = attn.heads(x, rope)
    logits = 0.125 * q @ k.transpose(-1, -2)
    assert logits.abs().max() <= bound * (1 + 1e-5)
    # the bound is tight: with k = q (same weights) a token's logit with itself reaches it
    with torch.no_grad():
        attn.qkv.weight[d:2 * d] = attn.qkv.weight[:d]
    q, k, _ = attn.heads(x, rope)
    diag = (0.125 * q @ k.transpose(-1, -2)).diagonal(dim1=-2, dim2=-1)
    assert diag.max() <= bound * (1 + 1e-5) and diag.min() >= bound * (1 - 1e-4)
    # and the model's reported attn_max_logit stays inside it too, with adversarial weights
    model = Transformer(SMALL, "fog")
    for block in model.blocks:
        nn.init.normal_(block.attn.qkv.weight, std=5.0)
    model.set_diagnostics(True)
    model(tokens(t=32), tokens(t=32, seed=1))
    assert 0 < model.diagnostics()["attn_max_logit"] <= 0.125 * SMALL.head_dim * (1 + 1e-5)
    llama = Transformer(SMALL, "llama")
    for block in llama.blocks:
        nn.init.normal_(block.attn.qkv.weight, std=5.0)
    llama.set_diagnostics(True)
    llama(tokens(t=32), tokens(t=32, seed=1))
    assert llama.diagnostics()["attn_max_logit"] > 10 * 0.125 * SMALL.head_dim  # unbounded without QK-norm


def test_fog_attention_is_qk_rmsnorm_then_rope_then_softmax_scale_0125():
    torch.manual_seed(1)
    model = Transformer(SMALL, "fog")
    attn, rope = model.blocks[0].attn, model.rope
    assert attn.scale == 0.125 and model.blocks[0].attn.q_norm is not None
    assert Transformer(SMALL, "llama").blocks[0].attn.scale == 1 / math.sqrt(SMALL.head_dim)
    x = torch.randn(2, 16, SMALL.d_model)
    b, t, d, h, hd = 2, 16, SMALL.d_model, SMALL.n_head, SMALL.head_dim
    q, k, v = (attn.qkv(x).view(b, t, 3, h, hd).permute(2, 0, 3, 1, 4))
    q, k = rope(rms_norm(q)), rope(rms_norm(k))  # norm first (gain 1), RoPE after it
    scores = 0.125 * q @ k.transpose(-1, -2)
    scores = scores.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
    y = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, d)
    torch.testing.assert_close(attn(x, rope), attn.proj(y), rtol=1e-5, atol=1e-6)
    # With the gain frozen at 1 norm and rotation commute (a rotation keeps the RMS); a non-uniform gain
    # makes the order observable: the code applies RoPE to g * RMSNorm(q), not g * RMSNorm(RoPE(q)).
    g = torch.linspace(0.5, 2.0, hd)
    attn.q_norm.weight.copy_(g)
    q_raw = attn.qkv(x).view(b, t, 3, h, hd).permute(2, 0, 3, 1, 4)[0]
    q_code = attn.heads(x, rope)[0]
    torch.testing.assert_close(q_code, rope(g * rms_norm(q_raw)), rtol=1e-5, atol=1e-6)
    assert not torch.allclose(q_code, g * rms_norm(rope(q_raw)), atol=1e-3)


def test_fog_qk_gains_are_frozen_at_one_and_untouched_by_training():
    torch.manual_seed(2)
    model = Transformer(SMALL, "fog")
    gains = [n for n, _ in model.named_buffers() if n.endswith(("q_norm.weight", "k_norm.weight"))]
    assert len(gains) == 2 * SMALL.n_layer
    param_names = {n for n, _ in model.named_parameters()}
    assert not any("q_norm" in n or "k_norm" in n for n in param_names)
    opt = torch.optim.AdamW(model.param_groups(0.1), lr=1e-2)
    assert not any(p is model.get_buffer(g) for group in opt.param_groups for p in group["params"] for g in gains)
    for step in range(2):
        loss = model(tokens(seed=step), tokens(seed=step + 10))
        loss.backward()
        opt.step()
        opt.zero_grad()
    for g in gains:
        buf = model.get_buffer(g)
        assert not buf.requires_grad and buf.grad is None
        assert torch.equal(buf, torch.ones(SMALL.head_dim))
    # the learnable gains did move: the optimizer really stepped
    assert not torch.allclose(model.blocks[0].attn_out_norm.weight, torch.full((SMALL.d_model,), 1 / math.sqrt(3)))


def test_fog_branch_output_norm_gains_start_at_one_over_sqrt_layers_and_are_learnable():
    for n_layer in (3, 16):
        cfg = ModelConfig(n_layer=n_layer, d_model=32, n_head=2, d_ff=32, seq_len=8)
        model = Transformer(cfg, "fog")
        for block in model.blocks:
            for norm in (block.attn_out_norm, block.mlp_out_norm):
                assert isinstance(norm.weight, nn.Parameter) and norm.weight.requires_grad
                torch.testing.assert_close(norm.weight.detach(), torch.full((32,), 1 / math.sqrt(n_layer)))


def test_fog_has_no_pre_norm_norms_each_branch_output_scales_embeddings_by_50_and_has_no_final_norm():
    torch.manual_seed(3)
    model = Transformer(SMALL, "fog")
    assert model.embed_scale == 50.0 and model.norm is None
    for block in model.blocks:  # learnable gains: make them differ from 1/sqrt(L) to see them applied
        for norm in (block.attn_out_norm, block.mlp_out_norm):
            with torch.no_grad():
                norm.weight.uniform_(0.2, 0.9)
    names = ["blocks.0", "head"] + [f"blocks.{i}.{m}" for i in range(3) for m in ("attn.qkv", "mlp.fc1")] \
        + [f"blocks.{i}" for i in range(1, 3)]
    seen, handles = capture(model, names)
    idx = tokens()
    model(idx)
    for h in handles:
        h.remove()
    x0 = seen["blocks.0"][0]
    torch.testing.assert_close(x0, model.embed.weight[idx] * 50, rtol=0, atol=0)  # x0 = Embed / sigma_init
    assert 0.8 < x0.pow(2).mean().sqrt() < 1.2  # sigma 0.02 x 50: unit-RMS residual stream at the start
    for i, block in enumerate(model.blocks):
        x = seen[f"blocks.{i}"][0]
        assert torch.equal(seen[f"blocks.{i}.attn.qkv"][0], x)  # attention reads the raw residual stream
        attn_out = block.attn(x, model.rope)
        delta = block.attn_out_norm.weight * rms_norm(attn_out)  # x + g_a * RMSNorm(attn(x))
        h_ = x + delta
        torch.testing.assert_close(seen[f"blocks.{i}.mlp.fc1"][0], h_, rtol=1e-5, atol=1e-5)  # raw, too
        out = h_ + block.mlp_out_norm.weight * rms_norm(block.mlp(h_))
        following = seen[f"blocks.{i + 1}"][0] if i + 1 < 3 else seen["head"][0]
        torch.testing.assert_close(following, out, rtol=1e-5, atol=1e-5)  # last block straight into the head
    assert not any(isinstance(m, RMSNorm) and m.weight.shape[0] == SMALL.d_model and "out_norm" not in n
                   for n, m in model.named_modules())


def test_xielu_formula_and_initial_values():
    act = XIELU()
    assert act.beta == 0.5 and act.eps == -1e-6
    torch.testing.assert_close(act.a_p.detach(), torch.tensor(math.log(math.exp(0.8) - 1)))
    torch.testing.assert_close(act.a_n.detach(), torch.tensor(math.log(math.exp(0.3) - 1)))
    assert abs(act.alpha_p.item() - 0.8) < 1e-6 and abs(act.alpha_n.item() - 0.8) < 1e-6
    x = torch.tensor([-30.0, -3.0, -1.0, -1e-3, -1e-7, 0.0, 1e-7, 1e-3, 0.5, 1.0, 4.0], dtype=torch.float64)
    ap, an, beta, eps = 0.8, 0.8, 0.5, -1e-6
    want = torch.where(x > 0, ap * x ** 2 + beta * x,
                       an * (torch.exp(torch.clamp(x, max=eps)) - 1) - an * x + beta * x)
    torch.testing.assert_close(act(x.float()).double(), want, rtol=1e-5, atol=1e-7)
    assert abs(act(torch.tensor(1.0)).item() - 1.3) < 1e-6  # 0.8 + 0.5
    assert abs(act(torch.tensor(-1.0)).item() - (0.8 * math.expm1(-1) + 0.8 - 0.5)) < 1e-6
    # alpha_p = softplus(a_p), alpha_n = beta + softplus(a_n): moving the raw parameters moves them so
    with torch.no_grad():
        act.a_p.fill_(0.3)
        act.a_n.fill_(-1.0)
    ap, an = F.softplus(torch.tensor(0.3)).item(), 0.5 + F.softplus(torch.tensor(-1.0)).item()
    want = torch.where(x > 0, ap * x ** 2 + beta * x, an * torch.expm1(torch.clamp(x, max=eps)) - an * x + beta * x)
    torch.testing.assert_close(act(x.float()).double(), want, rtol=1e-5, atol=1e-7)
    act(torch.randn(100)).sum().backward()
    assert act.a_p.grad.abs() > 0 and act.a_n.grad.abs() > 0


def test_fog_mlp_is_non_gated_xielu_at_1p5x_width_with_parameter_parity():
    fog, llama = Transformer(SMALL, "fog"), Transformer(SMALL, "llama")
    mlp = fog.blocks[0].mlp
    assert isinstance(mlp, XIELUMLP) and isinstance(llama.blocks[0].mlp, SwiGLU)
    assert mlp.fc1.weight.shape == (144, 64) and mlp.fc2.weight.shape == (64, 144)  # 1.5 x 96
    x = torch.randn(3, 64)
    torch.testing.assert_close(mlp(x), mlp.fc2(mlp.act(mlp.fc1(x))))

    def linear_params(model):
        return sum(m.weight.numel() for n, m in model.named_modules() if n.startswith("blocks") and
                   isinstance(m, nn.Linear))
    assert linear_params(fog) == linear_params(llama)


# ---- llama ----------------------------------------------------------------------------------------

def test_llama_is_pre_rmsnorm_swiglu_with_a_final_norm():
    torch.manual_seed(4)
    model = Transformer(SMALL, "llama")
    assert model.embed_scale == 1.0 and isinstance(model.norm, RMSNorm)
    block = model.blocks[0]
    for norm in (block.attn_norm, block.mlp_norm, model.norm):
        with torch.no_grad():
            norm.weight.uniform_(0.5, 1.5)
    seen, handles = capture(model, ["blocks.0", "blocks.0.attn.qkv", "blocks.0.mlp.fc1", "blocks.1", "head",
                                    f"blocks.{SMALL.n_layer - 1}"])
    idx = tokens()
    model(idx)
    for h in handles:
        h.remove()
    x = seen["blocks.0"][0]
    torch.testing.assert_close(x, model.embed.weight[idx], rtol=0, atol=0)
    torch.testing.assert_close(seen["blocks.0.attn.qkv"][0], block.attn_norm.weight * rms_norm(x))  # pre-norm
    h_ = x + block.attn(block.attn_norm(x), model.rope)
    torch.testing.assert_close(seen["blocks.0.mlp.fc1"][0], block.mlp_norm.weight * rms_norm(h_),
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(seen["blocks.1"][0], h_ + block.mlp(block.mlp_norm(h_)), rtol=1e-5, atol=1e-5)
    last = seen[f"blocks.{SMALL.n_layer - 1}"][1]
    torch.testing.assert_close(seen["head"][0], model.norm.weight * rms_norm(last), rtol=1e-5, atol=1e-5)
    # SwiGLU: fc1 = [gate | up] fused, out = fc2(silu(gate) * up), hidden d_ff
    mlp = block.mlp
    assert mlp.fc1.weight.shape == (2 * SMALL.d_ff, SMALL.d_model)
    assert mlp.fc2.weight.shape == (SMALL.d_model, SMALL.d_ff)
    z = torch.randn(4, SMALL.d_model)
    gate, up = z @ mlp.fc1.weight[:SMALL.d_ff].T, z @ mlp.fc1.weight[SMALL.d_ff:].T
    torch.testing.assert_close(mlp(z), (F.silu(gate) * up) @ mlp.fc2.weight.T)
    assert block.attn.q_norm is None


# ---- RoPE -----------------------------------------------------------------------------------------

def test_rope_scores_depend_only_on_relative_position_and_preserve_norms():
    torch.manual_seed(5)
    hd, rope = 32, Rotary(32, 256)
    q, k = torch.randn(hd, dtype=torch.float64), torch.randn(hd, dtype=torch.float64)

    def at(v, pos):  # v placed at position pos of a sequence
        seq = torch.zeros(pos + 1, hd)
        seq[pos] = v.float()
        return rope(seq)[pos].double()

    for delta in (0, 1, 7, 100):
        scores = [at(q, m + delta) @ at(k, m) for m in (0, 3, 50, 150)]
        for s in scores[1:]:
            assert abs(s - scores[0]) < 1e-4 * (1 + abs(scores[0]))
    assert abs(at(q, 0) @ at(k, 5) - at(q, 0) @ at(k, 6)) > 1e-3  # it does depend on the offset
    torch.testing.assert_close(at(q, 0), q, rtol=1e-6, atol=1e-6)  # position 0 is the identity
    torch.testing.assert_close(at(q, 77).norm(), q.norm(), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="max_seq_len"):
        rope(torch.zeros(257, hd))


# ---- configs and names ----------------------------------------------------------------------------

def test_named_configs():
    tiny, small, big = CONFIGS["tiny"], CONFIGS["124m"], CONFIGS["1.5b"]
    assert 2 <= tiny.n_layer <= 6 and 128 <= tiny.d_model <= 256 and 128 <= tiny.seq_len <= 256
    assert (small.n_layer, small.d_model, small.seq_len, small.head_dim) == (12, 768, 1024, 128)
    assert (big.n_layer, big.d_model, big.d_ff, big.n_head, big.seq_len) == (16, 2048, 8192, 16, 2048)
    assert big.head_dim == 128
    assert big.fog_d_ff == 12288 and small.fog_d_ff == 3072
    with torch.device("meta"):  # shapes and counts without allocating 1.5B parameters
        fog, llama = Transformer(big, "fog"), Transformer(big, "llama")
    block = 4 * 2048 ** 2 + 3 * 2048 * 8192
    for m in (fog, llama):
        assert sum(p.numel() for n, p in m.named_parameters() if n.startswith("blocks") and p.dim() == 2) == 16 * block
    assert get_config("tiny", seq_len=64).seq_len == 64
    with pytest.raises(ValueError, match="unknown config"):
        get_config("7b")


def test_module_names_read_well_in_the_monitor_and_the_agent_watches_the_block_gemms():
    model = Transformer(SMALL, "fog")
    watched = [n for n, _ in select_modules(model, r"^blocks\.")]
    assert watched == [f"blocks.{i}.{m}" for i in range(SMALL.n_layer)
                       for m in ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")]
    assert [n for n, _ in select_modules(model, None)] == watched + ["head"]


def test_fp8_precision_puts_every_block_gemm_in_fp8_and_keeps_head_and_embedding_high_precision():
    fp8 = pytest.importorskip("fp8mon.trainer.fp8_linear")
    model = Transformer(SMALL, "llama", "fp8", fp8.Fp8Recipe(scaling="delayed", amax_history_len=16))
    gemms = {n for n, m in model.named_modules() if isinstance(m, fp8.Fp8Linear)}
    assert gemms == {f"blocks.{i}.{m}" for i in range(SMALL.n_layer)
                     for m in ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")}
    assert type(model.head) is nn.Linear and type(model.embed) is nn.Embedding
    assert all(getattr(model.get_submodule(n), "fp8mon_linear", False) for n in gemms)
    w = model.blocks[0].attn.qkv.weight
    assert w.dtype == torch.float32 and w.shape == (3 * SMALL.d_model, SMALL.d_model)
    assert 0.015 < w.std().item() < 0.025  # our init reached the FP8 layer's master weight


def test_a_bf16_model_pickles_deep_copies_and_saves_whole_and_the_copies_compute_the_same():
    """A bf16 model's linears report their weights' rows through their own forward (layers.own_weight_row): whole-model
    pickling, deepcopy and torch.save keep it, bound to the copy's own linear."""
    import copy
    import io
    import pickle

    torch.manual_seed(0)
    net = Transformer(get_config("tiny", n_layer=1, d_model=32, n_head=2, d_ff=48, seq_len=8, vocab_size=64), "llama",
                      "bf16")
    buf = io.BytesIO()
    torch.save(net, buf)
    buf.seek(0)
    idx = torch.randint(0, 64, (2, 8))
    for other in (pickle.loads(pickle.dumps(net)), copy.deepcopy(net), torch.load(buf, weights_only=False)):
        qkv = other.blocks[0].attn.qkv
        assert qkv.forward.args[0] is qkv
        assert torch.equal(other(idx), net(idx))
