"""Train one small model that fp8mon did not write, with the agent attached as a user attaches it.

The models are a nanoGPT-style GPT-2 (bench/models/gpt2.py: LayerNorm, GELU, SDPA) and transformers' Llama built
from a ``LlamaConfig`` (RMSNorm, SwiGLU, RoPE), in bf16 autocast or torchao float8 (``convert_to_float8_training``,
emulated on a CPU, the lm_head left out as torchao's users do). The data is a synthetic language: a fixed random
order-1 Markov chain whose every token has a few likely successors, so the loss has a known floor and a healthy run
reaches it. The agent (``from fp8mon import Agent``) watches the blocks' linears (the ``weight`` and ``output``
sites by default: the sites where kurtosis warns, at a cost a 2-core machine affords at every step), reports at
every step and spools to a directory: its url points at a closed port, so every batch stays on disk where bench/corpus/make.py
reads it. The maximum attention logit of each step is computed by a forward hook from the layer's own q and k (with
RoPE for Llama) and logged with the loss, the gradient norm and the learning rate, as a user would.

What a scenario does (``Scenario``): ``stable`` (warm-up and cosine decay at a sane peak), ``lrjump`` (the learning
rate multiplied by ``factor`` from ``at`` on), ``restart`` (the cosine schedule restarted at its peak at ``at``),
``burst`` (``length`` steps of uniformly random tokens from ``at``: corrupted data, then clean data again),
``hot`` (a peak learning rate too high for the model: it trains, then stalls on a plateau).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

SIZES = {  # d, layers, heads, sequence, batch
    "tiny": dict(d=64, layers=2, heads=4, seq=64, batch=8, vocab=256),
    "small": dict(d=512, layers=8, heads=8, seq=256, batch=32, vocab=4096),
}


@dataclass
class Scenario:
    name: str
    model: str = "gpt2"  # gpt2 | llama
    precision: str = "bf16"  # bf16 | fp8
    kind: str = "stable"  # stable | lrjump | restart | burst | hot
    steps: int = 600
    seed: int = 1
    lr: float = 3e-3
    warmup: int = 100
    at: int | None = None  # step of the event (lrjump, restart, burst)
    factor: float = 20.0  # lrjump's multiplier; hot: the peak lr's multiplier
    length: int = 60  # burst length in steps
    size: str = "tiny"
    extra: dict = field(default_factory=dict)


def lr_at(s: Scenario, step: int) -> float:
    peak = s.lr * (s.factor if s.kind == "hot" else 1.0)
    if step < s.warmup:
        return peak * (step + 1) / s.warmup
    start, span = s.warmup, s.steps - s.warmup
    if s.kind == "restart" and step >= s.at:
        start, span = s.at, s.steps - s.at
    lr = 0.1 * peak + 0.9 * peak * 0.5 * (1 + math.cos(math.pi * (step - start) / max(1, span)))
    if s.kind == "lrjump" and step >= s.at:
        lr *= s.factor
    return lr


class MarkovText:
    """Token batches of a fixed random Markov chain (4 likely successors per token), or uniform noise. Clean
    batches are drawn from a pool of `pool` batches sampled once (sampling the chain costs more than a tiny
    model's step)."""

    def __init__(self, vocab: int, seed: int, batch: int, seq: int, pool: int = 256):
        g = torch.Generator().manual_seed(1000 + seed)
        logits = torch.full((vocab, vocab), -4.0)
        nxt = torch.randint(0, vocab, (vocab, 4), generator=g)
        logits.scatter_(1, nxt, torch.tensor([3.0, 2.0, 1.5, 1.0]).expand(vocab, 4).contiguous())
        self.probs = torch.softmax(logits, dim=1)
        self.vocab, self.shape = vocab, (batch, seq + 1)
        self.g = torch.Generator().manual_seed(seed)
        self.pool = self._sample(batch * pool, seq).view(pool, batch, seq + 1)

    def _sample(self, rows: int, seq: int) -> torch.Tensor:
        out = torch.empty(rows, seq + 1, dtype=torch.long)
        out[:, 0] = torch.randint(0, self.vocab, (rows,), generator=self.g)
        for t in range(seq):
            out[:, t + 1] = torch.multinomial(self.probs[out[:, t]], 1, generator=self.g)[:, 0]
        return out

    def batch(self, noise: bool = False) -> torch.Tensor:
        if noise:
            return torch.randint(0, self.vocab, self.shape, generator=self.g)
        return self.pool[int(torch.randint(0, self.pool.shape[0], (1,), generator=self.g))]


class MaxLogit:
    """The largest attention logit of the step's forward passes, from each layer's own q and k (no module call,
    so the agent's hooks see nothing of it)."""

    def __init__(self):
        self.value = torch.zeros(())

    def reset(self):
        self.value = torch.zeros(())

    def _keep(self, q: torch.Tensor, k: torch.Tensor):  # [b, h, t, hd]
        with torch.no_grad():
            logits = (q.float() @ k.float().transpose(-1, -2)) / math.sqrt(q.shape[-1])
            t = logits.shape[-1]
            mask = torch.ones(t, t, dtype=torch.bool, device=logits.device).tril()
            top = logits.masked_fill(~mask, -math.inf).amax()
            self.value = torch.maximum(self.value.to(top.device), top)

    def attach_gpt2(self, model):
        for block in model.transformer.h:
            attn = block.attn

            def hook(module, args, out, heads=attn.n_head):
                b, t, c3 = out.shape
                q, k, _ = out.detach().split(c3 // 3, dim=2)
                q, k = (z.reshape(b, t, heads, -1).transpose(1, 2) for z in (q, k))
                self._keep(q, k)

            attn.c_attn.register_forward_hook(hook)

    def attach_llama(self, model):
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        for layer in model.model.layers:
            attn = layer.self_attn

            def hook(module, args, kwargs):
                h = kwargs.get("hidden_states", args[0] if args else None).detach()
                cos, sin = kwargs["position_embeddings"]
                b, t, _ = h.shape
                hd = module.head_dim
                with torch.no_grad():
                    q = F.linear(h, module.q_proj.weight, module.q_proj.bias).view(b, t, -1, hd).transpose(1, 2)
                    k = F.linear(h, module.k_proj.weight, module.k_proj.bias).view(b, t, -1, hd).transpose(1, 2)
                    q, k = apply_rotary_pos_emb(q, k, cos, sin)
                self._keep(q, k)

            attn.register_forward_pre_hook(hook, with_kwargs=True)


def build(s: Scenario):
    dims = SIZES[s.size]
    torch.manual_seed(s.seed)
    if s.model == "gpt2":
        from bench.models.gpt2 import GPT, GPTConfig

        model = GPT(GPTConfig(block_size=dims["seq"], vocab_size=dims["vocab"], n_layer=dims["layers"],
                              n_head=dims["heads"], n_embd=dims["d"]))
        forward = lambda x, y: model(x, y)[1]  # noqa: E731
    else:
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(hidden_size=dims["d"], num_hidden_layers=dims["layers"],
                             num_attention_heads=dims["heads"], num_key_value_heads=dims["heads"],
                             intermediate_size=dims["d"] * 2, vocab_size=dims["vocab"],
                             max_position_embeddings=dims["seq"], tie_word_embeddings=False, use_cache=False,
                             attn_implementation="sdpa")
        model = LlamaForCausalLM(config)
        forward = lambda x, y: F.cross_entropy(model(input_ids=x).logits.flatten(0, 1).float(), y.flatten())  # noqa: E731
    if s.precision == "fp8":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        emulate = not torch.cuda.is_available()
        convert_to_float8_training(model, config=Float8LinearConfig(emulate=emulate),
                                   module_filter_fn=lambda m, fqn: "lm_head" not in fqn)
    return model, forward


def train(s: Scenario, spool: Path | None, device: str = "cpu", every: int = 1,
          sites: tuple[str, ...] = ("weight", "output")) -> dict:
    """Run the scenario; the agent's batches are left in `spool` (None: no agent, the losses are returned).
    Returns the run's config, its losses and timing."""
    from fp8mon import Agent

    dims = SIZES[s.size]
    model, forward = build(s)
    model.to(device)
    logit = MaxLogit()
    (logit.attach_gpt2 if s.model == "gpt2" else logit.attach_llama)(model)
    opt = torch.optim.AdamW(model.parameters(), lr=s.lr, betas=(0.9, 0.95), weight_decay=0.1)
    data = MarkovText(dims["vocab"], s.seed, dims["batch"], dims["seq"])
    config = {"scenario": asdict(s), "every": every}
    agent = None
    if spool is not None:
        agent = Agent("http://127.0.0.1:9", run=s.name, every=every, hist=False, stats_backend="torch", sites=sites,
                      modules=r"^(transformer\.h|model\.layers)\.", spool_dir=spool, config=config,
                      backoff=(30.0, 60.0)).watch(model)
    losses = []
    t0 = time.perf_counter()
    for step in range(s.steps):
        noise = s.kind == "burst" and s.at <= step < s.at + s.length
        tokens = data.batch(noise=noise).to(device)
        lr = lr_at(s, step)
        for group in opt.param_groups:
            group["lr"] = lr
        logit.reset()
        with torch.autocast(device_type=device, dtype=torch.bfloat16):
            loss = forward(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if agent is not None:
            agent.log(step, loss=loss.detach().float(), grad_norm=grad_norm, lr=lr, attn_max_logit=logit.value)
        losses.append((step, float(loss.detach()), float(logit.value)))
        if not math.isfinite(losses[-1][1]):
            break
    seconds = time.perf_counter() - t0
    if agent is not None:
        agent.close(timeout=1.0)
    return {"config": config, "seconds": seconds, "losses": losses}
