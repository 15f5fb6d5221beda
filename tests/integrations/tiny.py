"""What the callback tests share: a tiny Llama built from its config, token batches for it, and what an agent with a
``CaptureTransport`` sent, by step."""

from collections import defaultdict

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from fp8mon.agent.wire import SITES

VOCAB, HIDDEN, SEQ = 64, 32, 8
LINEARS = [f"model.layers.{i}.{name}" for i in range(2)
           for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")] + ["lm_head"]


def all_rows(prefix: str = "") -> set[tuple[str, str]]:
    """What every reporting step sends: each linear layer at each site."""
    return {(prefix + layer, site) for layer in LINEARS for site in SITES}


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=4 * SEQ)
    return LlamaForCausalLM(config)


def token_examples(n: int, seed: int = 1) -> list[dict]:
    """``n`` examples of SEQ tokens, each its own label (the model shifts them)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


def sent_rows(transport) -> dict[int, dict[tuple[str, str], dict]]:
    """step -> (layer, site) -> the statistics sent for it (rank 0)."""
    out: dict = defaultdict(dict)
    for (step, layer, site, rank), rec in transport.records().items():
        out[step][(layer, site)] = rec
    return dict(out)


def sent_scalars(transport) -> dict[int, dict[str, float]]:
    """step -> name -> value; a scalar sent twice for one step fails."""
    out: dict = defaultdict(dict)
    for block in transport.scalars:
        for name, value in zip(block["name"], block["value"]):
            assert name not in out[block["step"]], f"scalar {name} of step {block['step']} sent twice"
            out[block["step"]][name] = value
    return dict(out)
