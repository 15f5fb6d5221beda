"""`fp8mon demo`: the monitor on a SQLite file and a short real FP8 training run with the agent attached.

The server runs in this process (uvicorn, main thread). A trainer thread runs `fp8mon train` (the tiny
Llama config in FP8 by default, on the GPU when there is one, else on the CPU's reference path) with the
agent pointed at the server: every few steps the agent posts the statistics of every block linear's input,
weight, output, grad_output and grad_weight, plus loss, grad_norm, lr and tokens/s, through the real ingest
endpoint. When the training ends the demo prints the URLs to open and serves until Ctrl-C.
"""

from __future__ import annotations

import argparse
import re
import socket
import sys
import threading
from datetime import datetime
from typing import TYPE_CHECKING
from urllib.parse import quote

import httpx

if TYPE_CHECKING:
    from fp8mon.monitor.settings import Settings

DEMO_TRAIN_DEFAULTS = {"--arch": "llama", "--precision": "fp8", "--config": "tiny", "--batch-size": "8",
                       "--monitor-every": "5", "--log-every": "10"}


def train_argv(args: argparse.Namespace, base_url: str, run: str, token: str | None) -> list[str]:
    """The `fp8mon train` arguments of the demo's run: its defaults, the demo's flags, then the extra
    trainer flags given after `--` (which win)."""
    argv: list[str] = []
    for flag, value in DEMO_TRAIN_DEFAULTS.items():
        argv += [flag, value]
    argv += ["--steps", str(args.steps), "--device", args.device, "--monitor-url", base_url, "--run-name", run]
    if token:
        argv += ["--monitor-token", token]
    extra = list(args.train_args or [])
    if extra[:1] == ["--"]:
        extra = extra[1:]
    return argv + extra


def _bind(host: str, port: int, *, fallback: bool) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        if not fallback:
            sock.close()
            raise
        sock.bind((host, 0))
        print(f"fp8mon demo: port {port} is busy, using {sock.getsockname()[1]} instead", flush=True)
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def _links(app, client: httpx.Client | None, base: str, run: str, run_id: int | None) -> list[tuple[str, str]]:
    """The URLs worth opening, from the routes this server actually has (its OpenAPI schema)."""
    links = [("API docs (OpenAPI)", f"{base}/docs")]
    if client is not None:
        try:
            page = client.get("/")
            if page.status_code == 200 and page.headers.get("content-type", "").startswith("text/html"):
                links.insert(0, ("dashboard", f"{base}/?run={quote(run, safe='')}"))
        except httpx.HTTPError:
            pass
    try:
        paths = app.openapi().get("paths", {})
    except Exception:  # a broken schema must not break the demo
        paths = {}
    for path, operations in sorted(paths.items(), key=lambda item: (item[0].count("/"), item[0])):
        get = operations.get("get")
        if get is None or not path.startswith("/api/v1/runs"):
            continue
        if any(p.get("required") and p.get("in") != "path" for p in get.get("parameters", [])):
            continue  # needs query parameters: see /docs
        names = re.findall(r"{([^}:]+)(?::[^}]*)?}", path)
        if len(names) > 1:
            continue
        url = path
        for name in names:
            value = str(run_id) if name.endswith("id") and run_id is not None else quote(run, safe="/:@+=")
            url = re.sub(r"{" + name + r"(?::[^}]*)?}", value, url)
        if client is not None:  # list only what answers: some need query parameters the schema cannot say
            try:
                if client.get(url).status_code != 200:
                    continue
            except httpx.HTTPError:
                continue
        links.append((f"GET {path}", f"{base}{url}"))
    links.append(("ingest endpoint (POST)", f"{base}/api/v1/ingest"))
    return links


def run_demo(args: argparse.Namespace, settings: Settings) -> int:
    import uvicorn

    from fp8mon.monitor.app import create_app
    from fp8mon.monitor.migrate import current_revision, upgrade
    from fp8mon.monitor.storage.engine import create_db_engine
    from fp8mon.trainer.train import build_parser as train_parser
    from fp8mon.trainer.train import run as train

    run = args.run or f"demo-fp8-{datetime.now():%Y%m%d-%H%M%S}"
    if args.steps < 1:
        print("fp8mon demo: --steps must be at least 1", file=sys.stderr)
        return 2

    engine = create_db_engine(settings.database_url)
    try:
        upgrade(engine)
        db = engine.url.render_as_string(hide_password=True)
        print(f"database {db} at schema revision {current_revision(engine)}", flush=True)
    finally:
        engine.dispose()

    port_given = "port" in settings.model_fields_set  # by --port or FP8MON_PORT
    try:
        sock = _bind(settings.host, settings.port, fallback=not port_given)
    except OSError as exc:
        print(f"fp8mon demo: cannot listen on {settings.host}:{settings.port}: {exc}", file=sys.stderr)
        return 2
    host = f"[{settings.host}]" if ":" in settings.host else settings.host
    shown = "127.0.0.1" if settings.host in ("0.0.0.0", "") else host
    base = f"http://{shown}:{sock.getsockname()[1]}"
    token = settings.write_tokens[0] if settings.write_tokens else None
    try:  # bad trainer flags fail here, before anything starts
        train_args = train_parser("fp8mon demo -- (trainer flags)").parse_args(train_argv(args, base, run, token))
    except SystemExit as exc:
        sock.close()
        return 2 if exc.code else 0

    app = create_app(settings)
    server = uvicorn.Server(uvicorn.Config(app, log_level=args.log_level, access_log=False, lifespan="on"))
    outcome: dict = {}

    def trainer() -> None:
        while not server.started:
            if server.should_exit:
                return
            threading.Event().wait(0.02)
        print(f"training {train_args.arch} {train_args.precision} {train_args.config} for {train_args.steps} "
              f"steps as run {run!r}, statistics every {train_args.monitor_every} steps to {base}", flush=True)
        try:
            result = train(train_args)
        except BaseException as exc:  # report and stop the server: the demo failed
            outcome["error"] = f"{type(exc).__name__}: {exc}"
            print(f"fp8mon demo: training failed: {outcome['error']}", file=sys.stderr, flush=True)
            server.should_exit = True
            return
        outcome["result"] = result
        stored = result.run_name or run  # the name the monitor stored the run under (a reused --run gets a suffix)
        reader = (settings.read_tokens or settings.write_tokens or [None])[0]
        with httpx.Client(base_url=base, timeout=10.0,
                          headers={"authorization": f"Bearer {reader}"} if reader else {}) as client:
            try:
                detail = client.get(f"/api/v1/runs/{quote(stored, safe='')}").json()
                print(f"run {stored!r} ({result.status}): steps {detail.get('first_step')}..{detail.get('last_step')}"
                      f" stored, {detail.get('tensor_series')} layer x site series, status {detail.get('status')}",
                      flush=True)
            except (httpx.HTTPError, ValueError) as exc:
                print(f"fp8mon demo: cannot read the run back: {exc}", file=sys.stderr, flush=True)
            links = _links(app, client, base, stored, None)
        width = max(len(label) for label, _ in links)
        for label, url in links:
            print(f"  {label:<{width}}  {url}", flush=True)
        if args.exit_after_train:
            server.should_exit = True
        else:
            print("serving until Ctrl-C", flush=True)

    thread = threading.Thread(target=trainer, name="fp8mon-demo-trainer", daemon=True)
    thread.start()
    print(f"fp8mon monitor listening on {base}", flush=True)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        pass
    finally:
        sock.close()
    thread.join(timeout=60)
    if "error" in outcome:
        return 1
    if args.exit_after_train and "result" not in outcome:
        print("fp8mon demo: the server stopped before the training finished", file=sys.stderr)
        return 1
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--database-url", help="SQLAlchemy URL (env FP8MON_DATABASE_URL); default: a SQLite file "
                                               "under ./.fp8mon/, created and migrated")
    parser.add_argument("--host", help="bind address (env FP8MON_HOST; default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="port (env FP8MON_PORT; default 8080, or a free one if 8080 is "
                                                  "busy and no port was asked for; 0: any free port)")
    parser.add_argument("--run", help="run name (default demo-fp8-<date>-<time>)")
    parser.add_argument("--steps", type=int, default=150, help="training steps (default 150)")
    parser.add_argument("--device", default="auto", help="auto (a GPU when there is one), cpu, cuda (default auto)")
    parser.add_argument("--exit-after-train", action="store_true", help="stop the server once the training has "
                                                                        "ended (for tests and scripts)")
    parser.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"])
    parser.add_argument("train_args", nargs=argparse.REMAINDER, metavar="-- TRAINER FLAGS",
                        help="more `fp8mon train` flags after --, e.g. -- --arch fog --lr 3e-3 "
                             f"(the demo's defaults: {' '.join(f'{k} {v}' for k, v in DEMO_TRAIN_DEFAULTS.items())})")
