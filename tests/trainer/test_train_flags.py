"""Additive trainer flags used by the labelled-run corpus (scripts/make_fixtures.py): `--schedule constant`,
`--no-qk-norm` and `--fp8-backend`; the defaults are unchanged."""

import pytest
import torch

from fp8mon.trainer.config import get_config
from fp8mon.trainer.model import Transformer
from fp8mon.trainer.train import build_parser, lr_at


def test_constant_schedule_holds_the_peak_after_the_warm_up():
    kw = dict(lr=1.0, min_lr=0.1, warmup=10, steps=110)
    assert lr_at(0, schedule="constant", **kw) == pytest.approx(0.1)
    assert [lr_at(s, schedule="constant", **kw) for s in (9, 10, 60, 109, 500)] == [1.0] * 5
    assert lr_at(60, schedule="cosine", **kw) == pytest.approx(0.55)  # the default is still cosine
    assert build_parser().parse_args([]).schedule == "cosine"


def test_no_qk_norm_drops_the_fog_qk_norm_and_defaults_keep_it():
    cfg = get_config("tiny", n_layer=1, d_model=32, n_head=2, d_ff=64, seq_len=16)
    assert build_parser().parse_args([]).no_qk_norm is False
    assert build_parser().parse_args(["--no-qk-norm"]).no_qk_norm is True
    fog = Transformer(cfg, "fog")
    ablated = Transformer(cfg, "fog", qk_norm=False)
    llama = Transformer(cfg, "llama")
    assert fog.blocks[0].attn.q_norm is not None
    assert ablated.blocks[0].attn.q_norm is None and ablated.blocks[0].attn.scale == fog.blocks[0].attn.scale
    assert llama.blocks[0].attn.q_norm is None
    assert Transformer(cfg, "llama", qk_norm=True).blocks[0].attn.q_norm is not None
    x = torch.randint(0, cfg.vocab_size, (2, 16))
    assert torch.isfinite(ablated(x, x)).all()


def test_fp8_backend_flag_picks_the_fp8_linears_kernels():
    from fp8mon.trainer.fp8_linear import Fp8Linear
    from fp8mon.trainer.train import _build

    assert build_parser().parse_args([]).fp8_backend == "auto"
    args = build_parser().parse_args(["--precision", "fp8", "--fp8-backend", "torch", "--config", "tiny",
                                      "--n-layer", "1", "--steps", "1"])
    _, raw, _, _, _, _, _ = _build(args, torch.device("cpu"), 1)
    linears = [m for m in raw.modules() if isinstance(m, Fp8Linear)]
    assert linears and all(m.backend == "torch" for m in linears)
