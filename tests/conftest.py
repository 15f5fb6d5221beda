"""Shared fixtures: databases (SQLite always, PostgreSQL when FP8MON_TEST_DATABASE_URL is set), the monitor
application in process (FastAPI's TestClient), and a real uvicorn server process on 127.0.0.1 for the tests
where the process matters (kill -9, several workers, Prometheus scraping, the browser, the CLI).

The server's packages are imported inside the fixtures, so that the GPU tests run on a machine with only the agent
and the trainer installed (`python3 -m pytest -m gpu tests`)."""

import os
import uuid
from contextlib import contextmanager

import pytest

PG_URL = os.environ.get("FP8MON_TEST_DATABASE_URL")
BACKENDS = ["sqlite", "postgresql"] if PG_URL else ["sqlite"]


def pytest_report_header(config):
    return f"fp8mon storage backends: {', '.join(BACKENDS)}"


# The modules that take the most time (sm_90a builds, replays of the labelled runs, Triton's interpreter, training, a
# browser), slowest first, by their seconds in a whole run: scripts/test.sh runs the suite on every CPU, whole files to
# a worker in this order (pytest-xdist's loadfile, --no-loadscope-reorder; a worker takes the next file when two tests
# of its own are left), and a long file started last would run alone at the end.
_SLOW_FIRST = ("trainer/test_launch_shared_memory.py",  # ~250 s with an empty Triton cache, 5 s with a warm one
               "monitor/test_predictors.py", "trainer/test_train.py", "web/test_run_list_and_ranks.py",
               "agent/test_exit_and_sync.py", "trainer/test_consumer_stats.py", "monitor/test_ingest_concurrency.py",
               "trainer/test_fused_stats.py", "agent/test_transport.py", "monitor/test_fuzz.py", "web/test_run_view.py",
               "trainer/test_fused_kernels.py", "monitor/test_demo.py", "monitor/test_evaluation.py",
               "bench/test_multi_gpu_smoke.py", "agent/test_triton_stats.py", "test_cli_errors.py",
               "monitor/test_poison.py", "monitor/test_queries.py", "web/test_dashboard.py", "test_readme_commands.py")


def pytest_collection_modifyitems(config, items):
    def rank(item) -> int:
        path = item.path.as_posix()
        return next((i for i, slow in enumerate(_SLOW_FIRST) if path.endswith(slow)), len(_SLOW_FIRST))

    items.sort(key=rank)  # stable: the rest keep their order


# The fixtures that take a database on every backend, and their scopes.
_BACKEND_FIXTURES = {"database_url": "function", "module_live_server": "module"}


@pytest.hookimpl(tryfirst=True)
def pytest_generate_tests(metafunc):
    """A test marked ``sqlite_only`` runs on SQLite alone: its subject is not the storage (training under torchrun, the
    agent's exit, the browser's view), and the storage tests cover PostgreSQL."""
    if metafunc.definition.get_closest_marker("sqlite_only") is None:
        return
    for name, scope in _BACKEND_FIXTURES.items():
        if name in metafunc.fixturenames:  # a parametrize mark takes precedence over the fixture's own params
            metafunc.definition.add_marker(pytest.mark.parametrize(name, ["sqlite"], indirect=True, scope=scope))


@pytest.fixture(scope="session")
def _postgres_admin():
    """Fails loudly when a PostgreSQL URL was given but the server cannot be reached."""
    if not PG_URL:
        yield None
        return
    from sqlalchemy import create_engine, text

    from fp8mon.monitor.storage.engine import normalise_url

    engine = create_engine(normalise_url(PG_URL), isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            conn.execute(text("select 1"))
    except Exception as exc:
        pytest.exit(f"FP8MON_TEST_DATABASE_URL={PG_URL} is set but PostgreSQL is unreachable: {exc}", returncode=3)
    yield engine
    engine.dispose()


def _postgres_schema_url(base: str, schema: str) -> str:
    from fp8mon.monitor.storage.engine import normalise_url

    sep = "&" if "?" in base else "?"
    return f"{normalise_url(base)}{sep}options=-csearch_path%3D{schema}"


@contextmanager
def _fresh_database(backend: str, directory, admin):
    """An empty, migrated database: a fresh SQLite file in ``directory``, or a fresh PostgreSQL schema."""
    from sqlalchemy import text

    from fp8mon.monitor.migrate import upgrade
    from fp8mon.monitor.storage.engine import create_db_engine

    if backend == "sqlite":
        url = f"sqlite:///{directory / 'fp8mon.db'}"
        engine = create_db_engine(url)
        upgrade(engine)
        engine.dispose()
        yield url
        return
    schema = f"t_{uuid.uuid4().hex[:12]}"
    with admin.connect() as conn:
        conn.execute(text(f"create schema {schema}"))
    url = _postgres_schema_url(PG_URL, schema)
    engine = create_db_engine(url)
    upgrade(engine)
    engine.dispose()
    yield url
    with admin.connect() as conn:
        conn.execute(text(f"drop schema {schema} cascade"))


@pytest.fixture(params=BACKENDS)
def database_url(request, tmp_path, _postgres_admin):
    """An empty, migrated database: a fresh SQLite file, or a fresh PostgreSQL schema."""
    with _fresh_database(request.param, tmp_path, _postgres_admin) as url:
        yield url


@pytest.fixture
def store(database_url):
    from fp8mon.monitor.storage import SqlAlchemyStore

    s = SqlAlchemyStore(database_url)
    yield s
    s.close()


@pytest.fixture
def one_torch_thread():
    """Tiny tensors: intra-op threads only contend (badly so on a loaded 2-core machine)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def app_factory(database_url):
    """`make(predictor_factory=None, **settings)`: a TestClient of the monitor application on the test database,
    with Settings fields as keyword arguments. Use it as a context manager (`with make() as client:`): the
    application's lifespan (pipeline, webhooks, compactor) runs inside the block, and a second block on the
    same database is a restarted server."""
    from fastapi.testclient import TestClient

    from fp8mon.agent.wire import CLIENT_HEADER
    from fp8mon.monitor.app import create_app
    from fp8mon.monitor.settings import Settings

    def make(predictor_factory=None, **settings) -> TestClient:
        app = create_app(Settings(database_url=database_url, **settings), predictor_factory=predictor_factory)
        return TestClient(app, headers={CLIENT_HEADER: "tests"})  # as the agent and the dashboard send it

    return make


@pytest.fixture
def client(app_factory):
    """The monitor application with default settings, in process."""
    with app_factory() as c:
        yield c


@pytest.fixture
def server_factory(database_url, tmp_path):
    from fp8mon.monitor.localserver import ServerProcess

    servers: list = []

    def make(**env):
        server = ServerProcess(database_url, env={k: str(v) for k, v in env.items()},
                               log=tmp_path / f"server{len(servers)}.log")
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.stop()


@pytest.fixture
def live_server(server_factory):
    return server_factory().start()


@pytest.fixture(scope="module", params=BACKENDS)
def module_live_server(request, tmp_path_factory, _postgres_admin):
    """One server for a module's tests on each backend, for tests that each write and read runs of their own names
    (a server process costs seconds to start)."""
    from fp8mon.monitor.localserver import ServerProcess

    directory = tmp_path_factory.mktemp("module-server")
    with _fresh_database(request.param, directory, _postgres_admin) as url:
        server = ServerProcess(url, log=directory / "server.log").start()
        yield server
        server.stop()
