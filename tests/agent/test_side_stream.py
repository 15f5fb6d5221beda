"""Reads on the side stream (agent/side_stream.py): few programs in big chunks, and only on CUDA. The reads themselves
are checked against the rows of a run without them on a GPU (tests/trainer/test_graphs.py)."""

import torch

from agent import side_stream
from agent import triton_stats as ts


def test_a_side_launch_cuts_its_tensors_into_about_the_programs_asked_for():
    cuda = torch.device("cuda")  # only the device's type is read when the programs are given
    tile = ts.ROWS * 8
    for numels in ([16 * 1024 * 768], [16 * 1024 * 8192, 16 * 1024 * 2048]):  # 124M attention output; 1.5B fc1, fc2
        chunk = ts._chunk_elems(numels, cuda, ts.MAXNREG, programs=16)
        assert chunk % tile == 0
        assert 12 <= sum(-(-n // chunk) for n in numels) <= 16
    assert ts._chunk_elems([2 * 10**9], cuda, ts.MAXNREG, programs=16) == ts.SIDE_CHUNK  # the words path's limit
    assert ts._chunk_elems(numels, torch.device("cpu"), ts.MAXNREG, programs=16) == ts.CHUNK


def test_nothing_goes_to_a_side_stream_off_cuda_or_unless_asked(monkeypatch):
    monkeypatch.setattr(side_stream, "ENABLED", True)
    assert not side_stream.wanted(torch.device("cpu"))
    assert side_stream.wanted(torch.device("cuda", 0))
    monkeypatch.setattr(side_stream, "ENABLED", False)
    assert not side_stream.wanted(torch.device("cuda", 0))
    side_stream.join()  # nothing forked: nothing to wait for, and no CUDA call
