"""Model shapes: one dataclass and the named configs (``--config tiny|124m|1.5b``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

ARCHS = ("llama", "fog")
PRECISIONS = ("fp8", "bf16", "fp32")


@dataclass(frozen=True)
class ModelConfig:
    n_layer: int
    d_model: int
    n_head: int
    d_ff: int                  # SwiGLU hidden width; FOG's non-gated xIELU MLP uses fog_ffn_mult x this
    seq_len: int
    vocab_size: int = 256      # byte-level by default; set from the data (see data.vocab_size)
    init_std: float = 0.02     # sigma_init: weights ~ N(0, sigma); FOG multiplies embeddings by 1/sigma
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    fog_ffn_mult: float = 1.5  # xIELU width for parameter parity with SwiGLU: 2*d*(1.5h) = 3*d*h
    fog_softmax_scale: float = 0.125

    def __post_init__(self):
        if self.d_model % self.n_head:
            raise ValueError(f"d_model {self.d_model} is not a multiple of n_head {self.n_head}")
        if self.head_dim % 2:
            raise ValueError("RoPE needs an even head_dim")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def fog_d_ff(self) -> int:
        return int(round(self.d_ff * self.fog_ffn_mult))

    def to_dict(self) -> dict:
        return asdict(self)

    def with_(self, **changes) -> ModelConfig:
        return replace(self, **{k: v for k, v in changes.items() if v is not None})


CONFIGS: dict[str, ModelConfig] = {
    # CPU demo and tests: trains in seconds. head_dim 32.
    "tiny": ModelConfig(n_layer=4, d_model=128, n_head=4, d_ff=384, seq_len=128),
    # GPT-2-small shape (12 x 768, MLP 4d = 3072 for FOG's xIELU, SwiGLU 2/3 of that), head_dim 128.
    "124m": ModelConfig(n_layer=12, d_model=768, n_head=6, d_ff=2048, seq_len=1024),
    # FOG paper's 1.5B (16 layers, d 2048, FFN 8192, 16 heads, head_dim 128); xIELU width 12288.
    "1.5b": ModelConfig(n_layer=16, d_model=2048, n_head=16, d_ff=8192, seq_len=2048),
}


def get_config(name: str, **overrides) -> ModelConfig:
    try:
        base = CONFIGS[name]
    except KeyError:
        raise ValueError(f"unknown config {name!r}; choose from {', '.join(CONFIGS)}") from None
    return base.with_(**overrides)
