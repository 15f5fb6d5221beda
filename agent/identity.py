"""Run identity on the agent's side: the run's id, the resume mode (W&B's), and the check that a resumed run's steps
continue after those the monitor has stored (docs/wire-format.md, "Run identity").

- ``never`` (the default): a new run. The agent picks a fresh id (rank 0's, shared with every sending rank), and a
  name the monitor already has gets a suffix there (``name-2``).
- ``allow``: the run of ``run_id`` (or, without one, of the name) if the monitor has it, else a new one.
- ``must``: that run; the agent raises at construction when the monitor answers that it has none, and a batch the
  monitor refuses for it (409) is a counted, logged error.

Resuming asks the monitor once, at construction, for the run's last stored step; a step at or below it is dropped
and counted in ``agent.errors`` (as W&B drops a step that does not increase).
"""

from __future__ import annotations

import logging
import re
import uuid

import httpx

from . import wire
from .delivery import ResumeRefused

log = logging.getLogger("fp8mon.agent")

_RUN_ID = re.compile(wire.RUN_ID_PATTERN)
RESUME_TIMEOUT = 10.0  # seconds the construction may wait for the monitor's answer


class StepsGoBack(ValueError):
    """A resumed run logged a step the monitor has stored already."""


def check(resume: str, run_id: str | None) -> None:
    if resume not in wire.RESUME_MODES:
        raise ValueError(f"resume must be one of {wire.RESUME_MODES}, not {resume!r}")
    if run_id is None:
        return
    if not isinstance(run_id, str) or len(run_id) > wire.MAX_RUN_ID or not _RUN_ID.match(run_id):
        raise ValueError(f"invalid run_id {run_id!r}: 1 to {wire.MAX_RUN_ID} letters, digits, '_' or '-'")
    if resume == "never":
        raise ValueError("run_id names a run to resume: pass resume='allow' or 'must' with it (resume='never' "
                         "starts a new run with a new id)")


def new_run_id(group, world: int) -> str:
    """A fresh id, the same on every rank of ``group`` (rank 0's, broadcast: every rank must construct its Agent)."""
    from . import distributed  # torch: only an agent that trains gets here

    run_id = uuid.uuid4().hex
    if world > 1 and distributed.initialized():
        import torch.distributed as dist

        box = [run_id]
        src = dist.get_global_rank(group, 0) if group is not None else 0
        dist.broadcast_object_list(box, src=src, group=group)
        run_id = box[0]
    return run_id


def resume_point(ingest_url: str, run: str, run_id: str | None, resume: str, token: str | None) -> dict | None:
    """The monitor's answer on the run to resume: {"run", "run_uid", "last_step"}; None when it has no such run or did
    not answer. Raises ResumeRefused under ``must`` when it has no such run."""
    headers = {wire.CLIENT_HEADER: "agent"}
    if token:
        headers["authorization"] = f"Bearer {token}"
    body = {"run": run, **({"run_id": run_id} if run_id is not None else {})}
    endpoint = ingest_url + "/resume"
    try:
        response = httpx.post(endpoint, json=body, headers=headers, timeout=RESUME_TIMEOUT)
        response.raise_for_status()
        point = response.json()
    except (httpx.HTTPError, ValueError) as exc:
        log.warning("fp8mon: could not ask %s which run to resume (%s); resume=%r is checked when the first batch "
                    "arrives, and steps are not checked against the stored ones", endpoint, exc, resume)
        return None
    which = f"id {run_id!r}" if run_id is not None else f"name {run!r}"
    if not point.get("exists"):
        if resume == "must":
            raise ResumeRefused(f"the monitor at {ingest_url} has no run with {which} to resume (resume='must'); check "
                                f"run= / run_id=, or pass resume='allow' to create it")
        return None
    log.info("fp8mon: resuming run %r (id %s) after step %s", point.get("run"), point.get("run_uid"),
             point.get("last_step"))
    return point


def step_error(step: int, floor: int, run: str) -> StepsGoBack:
    return StepsGoBack(f"step {step} is at or below step {floor}, the last one the resumed run {run!r} has stored: "
                       f"its data is dropped; a resumed run continues after step {floor}")
