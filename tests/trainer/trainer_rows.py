"""Helpers of the trainer's statistics tests, beside tests/rowcheck.py's (``row_problems``, ``agent_rows``, which they
re-export). They import fp8mon inside each call, so that under the ``interpreted`` fixture they take its fresh copy."""

from __future__ import annotations

import torch
from rowcheck import agent_rows, row_problems

from fp8mon.agent.transport import NullTransport

__all__ = ["NullTransport", "agent_rows", "assert_rows", "hist_slack", "row_problems"]


def hist_slack(row: torch.Tensor) -> float:
    """The underflow slack of a row whose underflow comes from the histogram (exact up to the threshold's binade)."""
    from fp8mon.agent.stats import torch_path as ds

    return float(row[ds.HIST:].nan_to_num(0).max())


def assert_rows(a: torch.Tensor, b: torch.Tensor, **kw) -> None:
    problems = row_problems(a, b, **kw)
    assert not problems, problems
