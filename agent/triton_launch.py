"""Launching an already compiled Triton kernel without Triton's per-call work.

``kernel[grid](*args)`` costs tens of microseconds of host time per call even when the kernel is compiled:
Triton binds every argument, specializes it natively, builds a cache key, checks each global the kernel read
and wraps the launch in hooks. A training step with the agent attached makes hundreds of these launches, and
on a host-bound step each microsecond is step time. ``Launcher`` keeps, per specialization it has seen, the
``CompiledKernel`` that Triton's own first launch returned, and later calls its C launcher directly:
``launch(fn, grid, *args, **kwargs)`` in place of ``fn[grid](*args, **kwargs)``.

The key of a launch is what Triton specializes on, computed here in a few Python operations: each constexpr's
value, each tensor's dtype and 16-byte alignment, each integer's divisibility by 16, whether it is 1 and its
width (i32/i64/u64), the other arguments' types, the launch options (``num_warps``, ...) and the device. A
launch with anything else (a tensor descriptor, a tuple) takes Triton's path every time, as do all launches
under the interpreter, while a launch hook is set (profilers), or with ``FP8MON_DIRECT_LAUNCH=0``.

Not re-checked on the direct path: that the module globals a kernel reads kept the values it was compiled
with (Triton's check on every launch). The kernels launched here read only constants.
"""

from __future__ import annotations

import inspect
import os

import torch

try:
    import triton
    from triton import knobs
    from triton.runtime.driver import driver
except ImportError:  # pragma: no cover - the agent stays importable without Triton
    triton = None

ENABLED = (triton is not None and os.environ.get("FP8MON_DIRECT_LAUNCH", "1") != "0"
           and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"))

_NO_DEFAULT = object()


class _Unkeyable(Exception):
    pass


def _int_spec(v: int) -> tuple:
    # Triton: i32 / i64 / u64 by range, "divisible by 16" as a specialization
    width = 32 if -0x80000000 <= v <= 0x7FFFFFFF else (64 if -0x8000000000000000 <= v <= 0x7FFFFFFFFFFFFFFF else 65)
    return (int, width, v == 1, v % 16 == 0)


def _spec(v):
    """What Triton specializes a non-constexpr argument on (a superset is harmless: one more cache entry)."""
    t = type(v)
    if t is torch.Tensor or isinstance(v, torch.Tensor):
        return (v.dtype, v.data_ptr() % 16 == 0)
    if t is int:
        return _int_spec(v)
    if t is float or t is bool or v is None:
        return t
    raise _Unkeyable(t)


class Launcher:
    """``Launcher(fn)[grid](*args, **kwargs)`` launches the ``@triton.jit`` function ``fn`` as
    ``fn[grid](*args, **kwargs)`` does, directly once Triton has compiled that specialization."""

    def __init__(self, fn):
        self.fn = fn
        params = fn.params
        self._names = [p.name for p in params]
        self._index = {p.name: i for i, p in enumerate(params)}
        self._const = [p.is_constexpr for p in params]
        self._defaults = [_NO_DEFAULT if p.default is inspect.Parameter.empty else p.default for p in params]
        self._compiled: dict = {}
        self.direct_launches = 0  # for tests and benches

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.run(grid, args, kwargs)

    def key(self, args, kwargs) -> tuple[tuple, list]:
        """The specialization key of a launch on the current device, and every parameter's value in order
        (defaults filled in). Raises ``_Unkeyable`` for an argument it cannot key."""
        vals = list(args) + [_NO_DEFAULT] * (len(self._names) - len(args))
        opts = []
        for name, v in kwargs.items():
            i = self._index.get(name)
            if i is None:
                opts.append((name, v))
            else:
                vals[i] = v
        for i in range(len(args), len(vals)):
            if vals[i] is _NO_DEFAULT:
                vals[i] = self._defaults[i]
                if vals[i] is _NO_DEFAULT:
                    raise _Unkeyable(self._names[i])
        key = [tuple(opts)]
        key.extend([v if c else _spec(v) for v, c in zip(vals, self._const)])
        return tuple(key), vals

    def run(self, grid, args, kwargs):
        if not ENABLED or knobs.runtime.launch_enter_hook is not None or callable(grid):
            return self.fn[grid](*args, **kwargs)
        device = driver.active.get_current_device()
        compiled = self._compiled.get(device)
        if compiled is None:
            compiled = self._compiled[device] = {}
        try:
            key, vals = self.key(args, kwargs)
            kernel = compiled.get(key)
        except (_Unkeyable, TypeError):  # TypeError: an unhashable constexpr, or too many arguments
            return self.fn[grid](*args, **kwargs)
        if kernel is None:  # Triton's path: compiles, or finds the kernel in its own cache
            kernel = self.fn[grid](*args, **kwargs)
            if hasattr(kernel, "result"):  # an asynchronous compile
                kernel = kernel.result()
            if kernel is not None:
                compiled[key] = kernel
            return kernel
        kernel.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1,
                   driver.active.get_current_stream(device), kernel.function, kernel.packed_metadata, None, None,
                   None, *vals)
        self.direct_launches += 1
        return kernel


def launch(fn, grid, *args, **kwargs):
    """``fn[grid](*args, **kwargs)``, through ``fn``'s ``Launcher`` when ``fn`` is a ``@triton.jit`` function
    (anything else, e.g. a bench's stand-in for a kernel, is called as it is)."""
    direct = getattr(fn, "_fp8mon_launcher", None)
    if direct is None:
        if triton is None or not isinstance(fn, triton.runtime.JITFunction):
            return fn[grid](*args, **kwargs)
        direct = fn._fp8mon_launcher = Launcher(fn)
    return direct.run(grid, args, kwargs)
