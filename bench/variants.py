"""Settings of module attributes a bench measures one after another in one process: ``"default;mod.ATTR=1,mod.B=2"``
is two variants, the defaults and one with two attributes set (each value a Python literal)."""

from __future__ import annotations

import ast
import contextlib
import importlib


def parse(variant: str) -> list[tuple[object, str, object]]:
    """(module, attribute, value) of each ``module.ATTR=value`` of one variant ("default": none)."""
    out = []
    for item in (v.strip() for v in variant.split(",")):
        if item in ("", "default"):
            continue
        target, _, raw = item.partition("=")
        module_name, _, attr = target.strip().rpartition(".")
        if not module_name or not raw:
            raise ValueError(f"--variants: {item!r} is not module.ATTR=value")
        try:
            module = importlib.import_module(module_name)
            value = ast.literal_eval(raw.strip())
        except (ImportError, ValueError, SyntaxError) as e:
            raise ValueError(f"--variants: {item!r}: {e}") from None
        if not hasattr(module, attr):
            raise ValueError(f"--variants: {module_name} has no attribute {attr}")
        out.append((module, attr, value))
    return out


def parse_all(variants: str) -> list[tuple[str, list]]:
    """(name, assignments) of each ``;``-separated variant."""
    return [(v.strip(), parse(v)) for v in variants.split(";") if v.strip()]


@contextlib.contextmanager
def applied(assignments):
    """The attributes set for the block, and restored after it."""
    old = [(m, a, getattr(m, a)) for m, a, _ in assignments]
    try:
        for m, a, v in assignments:
            setattr(m, a, v)
        yield
    finally:
        for m, a, v in old:
            setattr(m, a, v)
