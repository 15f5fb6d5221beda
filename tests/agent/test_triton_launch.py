"""agent.triton_launch: the direct launch of compiled kernels must launch exactly what Triton would have
launched, so its key must change wherever Triton's specialization changes."""

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from agent import triton_launch as tlaunch  # noqa: E402


@triton.jit
def _scale_kernel(x_ptr, y_ptr, n, factor, BLOCK: tl.constexpr, OFFSET: tl.constexpr = 0):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=m) * factor + OFFSET, mask=m)


def _key(*args, **kwargs):
    return tlaunch.Launcher(_scale_kernel).key(args, kwargs)[0]


def test_key_follows_what_triton_specializes():
    x = torch.zeros(64, dtype=torch.float32)
    y = torch.zeros(64, dtype=torch.float32)
    base = _key(x, y, 32, 2.0, BLOCK=64)
    # the same specialization: other aligned tensors, another multiple of 16, another float
    assert _key(torch.ones(64), torch.ones(64), 48, 3.0, BLOCK=64) == base
    assert _key(x, y, 32, 2.0, BLOCK=64, OFFSET=0) == base  # a default given explicitly
    different = {
        "dtype": _key(x.bfloat16(), y, 32, 2.0, BLOCK=64),
        "alignment": _key(x[1:], y, 32, 2.0, BLOCK=64),
        "divisibility": _key(x, y, 33, 2.0, BLOCK=64),
        "one": _key(x, y, 1, 2.0, BLOCK=64),
        "width": _key(x, y, 2**32, 2.0, BLOCK=64),
        "constexpr": _key(x, y, 32, 2.0, BLOCK=128),
        "default constexpr": _key(x, y, 32, 2.0, BLOCK=64, OFFSET=1),
        "option": _key(x, y, 32, 2.0, BLOCK=64, num_warps=8),
        "type": _key(x, y, 32, 2, BLOCK=64),
    }
    for what, key in different.items():
        assert key != base, what
    assert len(set(different.values())) == len(different)


def test_unkeyable_launches_take_tritons_path():
    x = torch.zeros(64)
    with pytest.raises(tlaunch._Unkeyable):
        _key(x, x, 32, 2.0)  # BLOCK missing: Triton's own error, from its path
    with pytest.raises(tlaunch._Unkeyable):
        _key(x, x, (32, 1), 2.0, BLOCK=64)


def test_launch_calls_a_stand_in_as_it_is():
    seen = []

    class StandIn:
        def __getitem__(self, grid):
            return lambda *a, **k: seen.append((grid, a, k))

    tlaunch.launch(StandIn(), (3,), 1, 2, B=4)
    assert seen == [((3,), (1, 2), {"B": 4})]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_direct_launch_matches_tritons_on_gpu():
    if not tlaunch.ENABLED:
        pytest.skip("FP8MON_DIRECT_LAUNCH=0")
    launcher = _scale_kernel._fp8mon_launcher = tlaunch.Launcher(_scale_kernel)
    x = torch.randn(1000, device="cuda")
    for n, factor, offset in [(1000, 2.0, 0), (1000, -3.0, 0), (999, 0.5, 0), (1000, 2.0, 1)]:
        y = torch.zeros_like(x)
        tlaunch.launch(_scale_kernel, (triton.cdiv(n, 256),), x, y, n, factor, BLOCK=256, OFFSET=offset)
        want = torch.zeros_like(x)
        want[:n] = x[:n] * factor + offset
        torch.testing.assert_close(y, want)
    # (1000, 2.0, 0) compiled; (1000, -3.0, 0) reused it; 999 is not a multiple of 16 and OFFSET=1 is a new
    # constexpr: Triton's path for both
    assert launcher.direct_launches == 1
    y = torch.zeros(999, device="cuda")
    tlaunch.launch(_scale_kernel, (4,), x[1:], y, 999, 1.0, BLOCK=256)  # misaligned input: a new key
    torch.testing.assert_close(y, x[1:])
    assert launcher.direct_launches == 1
