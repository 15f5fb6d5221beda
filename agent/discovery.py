"""Why ``Agent.watch`` found nothing to watch: the message of the warning it logs then."""

from __future__ import annotations

import re
from collections import Counter

from torch import nn

from .hooks import is_linear

_SHOWN = 5


def _linear_like(module: nn.Module) -> bool:
    """A layer that does a linear layer's job without being one the hooks watch: Transformer Engine's ``Linear`` and
    ``LayerNormLinear``, GPT-2's ``Conv1D``, ... (a "Linear" in its class name, or a 2-D weight that is no
    embedding table)."""
    if is_linear(module) or isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
        return False
    weight = getattr(module, "weight", None)
    return "linear" in type(module).__name__.lower() or (isinstance(weight, nn.Parameter) and weight.dim() == 2)


def nothing_watched(model: nn.Module, pattern: re.Pattern | None, prefix: str = "") -> str:
    """What to tell a user whose model has no layer that ``pattern`` (None: any) selects in the names ``prefix``
    starts (``Agent.watch``'s)."""
    linears = [name for name, m in model.named_modules(prefix=prefix.rstrip(".")) if is_linear(m)]
    if linears and pattern is not None:
        shown = ", ".join(linears[:_SHOWN]) + (", ..." if len(linears) > _SHOWN else "")
        return (f"fp8mon: watching nothing: modules=r'{pattern.pattern}' matched none of the model's "
                f"{len(linears)} nn.Linear layers ({shown}); it is searched in their qualified names (re.search)")
    others = Counter(type(m).__name__ for m in model.modules() if _linear_like(m))
    if not others:
        return f"fp8mon: watching nothing: the model ({type(model).__name__}) has no nn.Linear layer"
    listed = ", ".join(f"{name} ×{n}" for name, n in others.most_common(_SHOWN))
    return (f"fp8mon: watching nothing: the model ({type(model).__name__}) has no nn.Linear layer; its linear-like "
            f"layers are of other classes: {listed}. fp8mon hooks nn.Linear and modules that set "
            f"fp8mon_linear = True")
