"""trainer/kernels/timing.py on a GPU: ``device_medians`` times the device alone, and says so where it cannot."""

import time
import warnings

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_calls_the_host_queues_faster_than_the_gpu_runs_them_are_timed_without_a_warning():
    from fp8mon.trainer.kernels.timing import device_medians

    x = torch.zeros(1 << 20, device="cuda")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        t = device_medians({"add": lambda: x.add_(1.0)}, rounds=2, calls=20)
    assert 0 < t["add"] < 1.0  # ms: a 4 MiB add, not the host's time


def test_calls_the_host_cannot_queue_within_the_sleep_are_flagged():
    from fp8mon.trainer.kernels.timing import device_medians

    x = torch.zeros(1024, device="cuda")

    def slow():
        time.sleep(0.01)  # 20 calls: 200 ms of host time, past the 10, 20 and 40 ms sleeps
        x.add_(1.0)

    with pytest.warns(UserWarning, match="may include the host's"):
        t = device_medians({"slow": slow}, rounds=1, calls=20)
    assert t["slow"] > 5.0  # ms per call: the host's gaps are in it, which is what the warning says
