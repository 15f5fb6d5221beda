"""Triton's interpreter without its repeated patching of ``triton.language``.

A kernel launch in the interpreter patches ``triton.language`` (its builtins to NumPy implementations) and restores it
afterwards; every call of a ``@triton.jit`` helper inside the kernel patches it again, though it is patched already:
``inspect.getmembers`` over the language's modules, about half the interpreter's time in our kernels, whose helpers
are many and small. ``patch_once`` makes such a call skip the patching when the language modules it sees are patched
already (their ``load`` no longer a builtin), which is what the repeated patching would leave them as: the kernels run
the same, in the interpreter, only sooner.
"""

from __future__ import annotations

import inspect

__all__ = ["patch_once"]


def patch_once() -> None:
    """Apply to the ``triton`` imported now (call after TRITON_INTERPRET=1 took effect, in the process that runs the
    kernels). Idempotent."""
    import triton.language as tl
    from triton.runtime import interpreter

    real = interpreter._patch_lang
    if getattr(real, "_fp8mon_once", False):
        return

    seen: dict = {}  # function -> the language modules among its globals

    def patch_lang(fn):
        langs = seen.get(fn)
        if langs is None:
            langs = seen[fn] = [v for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)]
        if langs and not any(tl.core.is_builtin(getattr(lang, "load", None)) for lang in langs):
            return interpreter._LangPatchScope()  # patched by the running launch: nothing to change or restore
        return real(fn)

    patch_lang._fp8mon_once = True
    interpreter._patch_lang = patch_lang
