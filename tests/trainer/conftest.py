"""Fixtures of the trainer's tests."""

import pytest
import torch
from trainer_interpreter import fresh_fp8mon


@pytest.fixture(scope="module")
def interpreted():
    """fp8mon afresh under Triton's interpreter for the module's tests (tests/trainer/trainer_interpreter.py), one CPU
    thread (the interpreter's numpy work gains nothing from more, and the suite's workers share the CPUs)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with fresh_fp8mon():
            yield
    finally:
        torch.set_num_threads(threads)
