"""transformers' ``LlamaForCausalLM`` from a ``LlamaConfig``, random weights, SDPA attention: 553M parameters
(hidden 1536, 16 layers, 12 heads of 128, MLP 4096, vocab 32000, sequences of 2048), 7 linears per layer and the
lm_head (113). transformers is imported here only, so that the GPT-2 runs need none."""

from __future__ import annotations

from torch import nn

__all__ = ["build_llama"]

FULL = dict(hidden_size=1536, num_hidden_layers=16, num_attention_heads=12, num_key_value_heads=12,
            intermediate_size=4096, vocab_size=32000, max_position_embeddings=2048)
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
            intermediate_size=128, vocab_size=256, max_position_embeddings=64)


def build_llama(tiny: bool) -> nn.Module:
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError as exc:
        raise RuntimeError("--model llama needs transformers (pip install transformers)") from exc
    config = LlamaConfig(**(TINY if tiny else FULL), tie_word_embeddings=False, use_cache=False,
                         attn_implementation="sdpa")
    return LlamaForCausalLM(config)
