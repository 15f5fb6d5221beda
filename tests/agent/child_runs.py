"""Helpers of the tests that run a training in a child process (train_child.py) against a real server."""

from pathlib import Path

from sqlalchemy import text

from fp8mon.monitor.storage import SqlAlchemyStore as Store

CHILD = Path(__file__).with_name("train_child.py")


def stored_loss_steps(database_url, run: str | None = None) -> list[int]:
    """The step of every stored loss value (of one run, or of all), in order (a step stored twice appears twice)."""
    store = Store(database_url)
    try:
        with store.engine.connect() as conn:
            of_run = "" if run is None else "and r.name = :run "
            rows = conn.execute(text("select s.step from scalars s join scalar_series ss on ss.id = s.series_id "
                                     f"join runs r on r.id = ss.run_id where ss.name = 'loss' {of_run}"
                                     "order by s.step"), {"run": run}).all()
        return [r[0] for r in rows]
    finally:
        store.close()
