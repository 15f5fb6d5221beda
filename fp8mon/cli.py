"""The `fp8mon` command: serve, db, demo, export, import, eval, sync, train.

Each command imports what it needs when it runs, so `fp8mon --help` and `fp8mon --version` work in an install
with the agent only (no server packages). A mistake (a missing extra, a bad database URL, a refused connection, a
port in use, an un-migrated database) ends in one line on stderr and a non-zero exit (`cli_errors`); `--debug`
shows the traceback instead.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from fp8mon import __version__
from fp8mon.cli_errors import CommandError, describe

if TYPE_CHECKING:
    from fp8mon.monitor.settings import Settings


def _add_db_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--database-url", help="SQLAlchemy URL (env FP8MON_DATABASE_URL); default: a SQLite file "
                                               "under ./.fp8mon/")


def _settings(args: argparse.Namespace) -> Settings:
    """FP8MON_* environment variables, overridden by the flags that were given."""
    from fp8mon.monitor.settings import Settings

    overrides = {key: value for key, value in vars(args).items()
                 if key in Settings.model_fields and value is not None}
    return Settings(**overrides)


def _export(settings: Settings) -> None:
    # uvicorn workers are fresh processes that build their settings from the environment.
    for name, value in settings.model_dump(mode="json").items():
        os.environ[f"FP8MON_{name.upper()}"] = json.dumps(value) if isinstance(value, list) else str(value)


def _check_port(host: str, port: int) -> None:
    """Bind the address as uvicorn will (SO_REUSEADDR), so that a port in use is one line, not uvicorn's log."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise CommandError(f"cannot bind {host}:{port}: {exc.strerror or exc}") from exc
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as exc:
            hint = "; pass --port (another fp8mon serve?)" if exc.errno == errno.EADDRINUSE else ""
            raise CommandError(f"cannot listen on {host}:{port}: {exc.strerror or exc}{hint}") from exc


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    import fp8mon.monitor.app  # noqa: F401  every server package, before anything starts
    from fp8mon.monitor.logconfig import log_config
    from fp8mon.monitor.migrate import SchemaError, check_schema, upgrade
    from fp8mon.monitor.storage.engine import create_db_engine

    settings = _settings(args)
    refusal = settings.serve_refusal()
    if refusal:
        print(f"fp8mon serve: {refusal}", file=sys.stderr)
        return 2
    if not settings.is_loopback() and not (settings.write_tokens or settings.read_tokens):
        print(f"fp8mon serve: WARNING: serving {settings.host}:{settings.port} without tokens (--allow-open): "
              "anyone who can reach it can write runs and acknowledge alerts", file=sys.stderr)
    engine = create_db_engine(settings.database_url)
    try:
        if args.migrate:
            upgrade(engine)
        check_schema(engine)
    except SchemaError as exc:
        raise CommandError(str(exc), 2) from exc
    finally:
        engine.dispose()
    _check_port(settings.host, settings.port)
    _export(settings)
    uvicorn.run("fp8mon.monitor.app:create_app", factory=True, host=settings.host, port=settings.port,
                workers=settings.workers, log_level=args.log_level, access_log=args.access_log,
                log_config=log_config(args.log_level, settings.log_format))
    return 0


def cmd_db_upgrade(args: argparse.Namespace) -> int:
    from fp8mon.monitor.migrate import current_revision, upgrade
    from fp8mon.monitor.storage.engine import create_db_engine

    settings = _settings(args)
    engine = create_db_engine(settings.database_url)
    try:
        upgrade(engine, args.revision)
        print(f"database {engine.url.render_as_string(hide_password=True)} at revision {current_revision(engine)}")
    finally:
        engine.dispose()
    return 0


def cmd_db_current(args: argparse.Namespace) -> int:
    from fp8mon.monitor.migrate import current_revision, head_revision
    from fp8mon.monitor.storage.engine import create_db_engine

    engine = create_db_engine(_settings(args).database_url)
    try:
        print(f"current: {current_revision(engine)}  head: {head_revision()}")
    finally:
        engine.dispose()
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from fp8mon.demo import run_demo

    return run_demo(args, _settings(args))


def cmd_export(args: argparse.Namespace) -> int:
    import gzip

    from fp8mon.monitor.export import export_run
    from fp8mon.monitor.migrate import SchemaError
    from fp8mon.monitor.storage import NotFound, SqlAlchemyStore

    store = SqlAlchemyStore(_settings(args).database_url)
    try:
        store.check_schema()
        batches = export_run(store, args.run, steps_per_batch=args.steps_per_batch, hist=not args.no_hist)
    except (NotFound, SchemaError) as exc:
        raise CommandError(getattr(exc, "message", str(exc))) from exc
    finally:
        store.close()
    data = json.dumps(batches).encode()
    opener = gzip.open if args.out.endswith(".gz") else open
    with opener(args.out, "wb") as f:
        f.write(data)
    print(f"{args.run}: {len(batches)} batches -> {args.out}")
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    from fp8mon.monitor import corpus

    paths = corpus.select(args.fixtures, args.match, args.limit)
    if not paths:
        where = args.fixtures or "the repository's tests/fixtures/runs"
        print(f"fp8mon import: no fixture in {where}" + (f" matching {args.match!r}" if args.match else ""),
              file=sys.stderr)
        return 1

    def show(item: corpus.Imported) -> None:
        again = f", {item.duplicates} already there" if item.duplicates else ""
        print(f"{item.run:<40} {item.outcome:<9} {item.batches} batches{again}", flush=True)

    if args.url:
        corpus.import_into_server(args.url, paths, token=args.token or os.environ.get("FP8MON_TOKEN"), progress=show)
        print(f"{len(paths)} runs sent to {args.url}: open {args.url.rstrip('/')}/")
        return 0
    from fp8mon.monitor.migrate import upgrade
    from fp8mon.monitor.storage import SqlAlchemyStore
    from fp8mon.monitor.storage.engine import create_db_engine

    settings = _settings(args)
    engine = create_db_engine(settings.database_url)
    try:
        upgrade(engine)
    finally:
        engine.dispose()
    store = SqlAlchemyStore(settings.database_url)
    try:
        corpus.import_into_store(store, paths, predict=not args.no_predict, predictor=settings.predictor,
                                 progress=show)
    finally:
        store.close()
    print(f"{len(paths)} runs stored; see them with: fp8mon serve" + (
        f" --database-url {args.database_url}" if args.database_url else ""))
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from fp8mon.eval_cli import run

    return run(args)


def cmd_sync(args: argparse.Namespace) -> int:
    from fp8mon.agent.spool import spool_root
    from fp8mon.agent.sync import sync

    url = args.url or os.environ.get("FP8MON_URL")
    if not url:
        print("fp8mon sync: no monitor address: pass --url or set FP8MON_URL", file=sys.stderr)
        return 2
    if not args.spool_dirs and not spool_root().is_dir():
        print(f"fp8mon sync: nothing to replay: {spool_root()} does not exist", file=sys.stderr)
        return 0
    return sync(args.spool_dirs or [spool_root()], url, args.token or os.environ.get("FP8MON_TOKEN"))


def cmd_train(args: argparse.Namespace) -> int:
    from fp8mon.trainer.train import main as train_main  # torch only for this command

    return train_main(args.train_args, prog="fp8mon train")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fp8mon", description="Training-health monitoring for FP8 training.")
    parser.add_argument("--version", action="version", version=f"fp8mon {__version__}")
    parser.add_argument("--debug", action="store_true", help="on an error, show the traceback")
    debug = argparse.ArgumentParser(add_help=False)  # --debug after the command too
    debug.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                       help="on an error, show the traceback")
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", parents=[debug], help="run the monitor server")
    _add_db_flag(serve)
    serve.add_argument("--host", help="bind address (env FP8MON_HOST; default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port (env FP8MON_PORT; default 8080)")
    serve.add_argument("--workers", type=int, help="uvicorn worker processes (env FP8MON_WORKERS; default 1)")
    serve.add_argument("--allow-open", action="store_const", const=True,
                       help="allow a --host beyond loopback without tokens (env FP8MON_ALLOW_OPEN)")
    serve.add_argument("--log-format", choices=["text", "json"], help="env FP8MON_LOG_FORMAT; default text")
    serve.add_argument("--migrate", action="store_true", help="apply pending migrations before serving")
    serve.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    serve.add_argument("--no-access-log", dest="access_log", action="store_false")
    serve.set_defaults(func=cmd_serve)

    db = commands.add_parser("db", help="database schema").add_subparsers(dest="db_command", required=True)
    up = db.add_parser("upgrade", parents=[debug], help="apply migrations (Alembic)")
    _add_db_flag(up)
    up.add_argument("revision", nargs="?", default="head")
    up.set_defaults(func=cmd_db_upgrade)
    current = db.add_parser("current", parents=[debug], help="show the schema revision")
    _add_db_flag(current)
    current.set_defaults(func=cmd_db_current)

    from fp8mon.demo import add_arguments as add_demo_arguments

    demo = commands.add_parser("demo", parents=[debug], help="serve a SQLite monitor and run a short FP8 training "
                                                             "with the agent attached")
    add_demo_arguments(demo)
    demo.set_defaults(func=cmd_demo)

    export = commands.add_parser("export", parents=[debug],
                                 help="write a stored run as wire-format ingest batches (JSON list)")
    _add_db_flag(export)
    export.add_argument("run", help="run name")
    export.add_argument("--out", required=True, help="output file; gzip when it ends in .gz")
    export.add_argument("--steps-per-batch", type=int, default=10)
    export.add_argument("--no-hist", action="store_true", help="leave the log2 histograms out")
    export.set_defaults(func=cmd_export)

    imp = commands.add_parser("import", parents=[debug],
                              help="load the labelled runs (stable and diverging, FP8 and BF16) into a database or a "
                                   "running server, to see the dashboard full")
    _add_db_flag(imp)
    imp.add_argument("--url", help="post to this running monitor instead of writing a database")
    imp.add_argument("--token", help="the server's ingest token (env FP8MON_TOKEN), with --url")
    imp.add_argument("--fixtures", type=Path, help="folder of <run>.json.gz fixtures (default: the repository's "
                                                   "tests/fixtures/runs)")
    imp.add_argument("--match", help="only files matching this glob or name prefix (e.g. 'cpu-fog-*-long-*')")
    imp.add_argument("--limit", type=int, help="at most this many runs")
    imp.add_argument("--no-predict", action="store_true", help="store the batches only: no predictions or alerts")
    imp.set_defaults(func=cmd_import)

    from fp8mon.eval_cli import add_arguments as add_eval_arguments

    evaluate = commands.add_parser("eval", parents=[debug],
                                   help="replay labelled runs through the predictors and score their warnings against "
                                        "the failures")
    add_eval_arguments(evaluate)
    evaluate.set_defaults(func=cmd_eval)

    sync = commands.add_parser("sync", parents=[debug],
                               help="deliver the batches runs left in their spools (idempotent)")
    sync.add_argument("spool_dirs", nargs="*", type=Path, metavar="SPOOL_DIR",
                      help="spool directories (default: every run's, under ~/.cache/fp8mon/spool)")
    sync.add_argument("--url", help="the monitor's base address (env FP8MON_URL)")
    sync.add_argument("--token", help="an ingest token (env FP8MON_TOKEN)")
    sync.set_defaults(func=cmd_sync)

    # No option of its own (prefix_chars): every argument, --help too, goes to trainer.train untouched.
    train = commands.add_parser("train", add_help=False, prefix_chars="\0",
                                help="train the FP8 LM (flags: fp8mon train --help)")
    train.add_argument("train_args", nargs=argparse.REMAINDER)
    train.set_defaults(func=cmd_train)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        if args.debug:
            raise
        described = describe(exc)
        line, code = described if described is not None else (f"{type(exc).__name__}: {exc}", 1)
        line = " ".join(line.split())  # one line, whatever the message held
        hint = "" if described is not None else " (fp8mon --debug shows the traceback)"
        command = " ".join(filter(None, (args.command, getattr(args, "db_command", None))))
        print(f"fp8mon {command}: {line}{hint}", file=sys.stderr)
        return code


if __name__ == "__main__":
    sys.exit(main())
