"""A fleet of runs written fast through the store (no HTTP): many runs, firing alerts spread over them, and one
old run that is the worst of all — what the run listing must rank and count right at scale."""

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from fp8mon.monitor.alerting.lifecycle import Alert
from fp8mon.monitor.storage.entities import AlertWrite, PredictionRecord
from fp8mon.monitor.wire import IngestBatch

SEARCHED = ("fog-a", "fog-b", "fog-c", "fog-d", "fog-e")  # old runs, far from the newest page
WORST = "old-diverged"
WAVE = 32  # runs created together; the worst and the searched runs are in the first wave


@dataclass
class Fleet:
    names: list[str]  # in creation order (oldest first) by waves of WAVE
    firing: dict[str, dict[str, int]] = field(default_factory=dict)  # run -> severity -> firing alerts


def add_run(store, name: str, *, tags: dict | None = None, step: int = 0) -> int:
    body = {"version": 1, "batch_id": f"fleet-{name}", "run": name,
            "scalars": {"step": [step], "name": ["loss"], "value": [1.0]}}
    if tags:
        body["run_meta"] = {"tags": tags}
    return store.ingest(IngestBatch.model_validate(body)).run_id


def _add_runs(store, names: list[str]) -> dict[str, int]:
    """Concurrent writers in waves (the store commits them in groups): a wave's runs are created after the
    previous wave's, in no set order among themselves."""
    ids: dict[str, int] = {}
    with ThreadPoolExecutor(max_workers=8) as pool:
        for lo in range(0, len(names), WAVE):
            wave = list(enumerate(names))[lo:lo + WAVE]
            futures = {name: pool.submit(add_run, store, name, step=i,
                                         tags={"team": "fog" if name in SEARCHED else "main"}) for i, name in wave}
            ids.update({name: f.result() for name, f in futures.items()})
    return ids


def add_alerts(store, run_id: int, run: str, alerts: list[tuple[str, str]]) -> None:
    """(severity, state) pairs, each a distinct alert of the run."""
    writes = []
    for i, (severity, state) in enumerate(alerts):
        alert = Alert(run=run, rule="kurtosis_jump", layer=f"blocks.{i}.mlp", site="input", severity=severity,
                      state=state, message=f"{severity} {state} {i}", first_step=0, last_step=2,
                      fired_step=None if state == "pending" else 1, resolved_step=2 if state == "resolved" else None)
        writes.append(AlertWrite(alert, resolved=state == "resolved"))
    store.record_assessments(run_id, [], writes, {})


def make_fleet(store, n: int = 1000, noisy_from: int | None = None) -> Fleet:
    """`n` runs, oldest first: the worst run third; five fog-* runs among the oldest; every 50th older run with
    a critical and a warning alert firing; the newest ones (from `noisy_from`) with four info alerts firing
    each, written last, so that they are the most recently updated alerts (more than 1,000 of them at n=1000)."""
    noisy_from = n - 300 if noisy_from is None else noisy_from
    names = [f"run-{i:04d}" for i in range(n)]
    names[2] = WORST
    names[10:10 + len(SEARCHED)] = SEARCHED
    fleet = Fleet(names)
    ids = _add_runs(store, names)
    plans: dict[str, list[tuple[str, str]]] = {
        WORST: [("critical", "firing")] * 5 + [("warning", "firing"), ("critical", "resolved"),
                                               ("critical", "pending"), ("info", "resolved")]}
    for i, name in enumerate(names[:noisy_from]):
        if i % 50 == 0 and name != WORST:
            plans[name] = [("critical", "firing"), ("warning", "firing"), ("warning", "resolved")]
    for name in names[noisy_from:]:
        plans[name] = [("info", "firing")] * 4
    add_alerts(store, ids[WORST], WORST, plans[WORST])  # first: the oldest alerts
    with ThreadPoolExecutor(max_workers=8) as pool:
        for future in [pool.submit(add_alerts, store, ids[name], name, alerts) for name, alerts in plans.items()
                       if name != WORST]:
            future.result()
    for name, alerts in plans.items():
        counts: dict[str, int] = {}
        for severity, state in alerts:
            if state == "firing":
                counts[severity] = counts.get(severity, 0) + 1
        fleet.firing[name] = counts
    predictions = [PredictionRecord(step=s, risk=r, steps_to_divergence=None, signals={}, culprits=[])
                   for s, r in ((0, 0.2), (1, 0.95))]
    store.record_assessments(ids[WORST], predictions, [], {})
    return fleet
