"""`fp8mon demo`: the monitor on a SQLite file, fed a built-in synthetic FP8 training run.

The server runs in this process (uvicorn, main thread); a feeder thread posts the run through the real
HTTP ingest endpoint as msgpack batches of the wire format (docs/wire-format.md), each with its own
batch id, retried with the same id on a 503 or a dropped connection, so a retry is stored once.

The story: a Llama-style model (8 blocks x 4 linears, FP8 with delayed scaling) whose loss falls
normally until the kurtosis of the input of one MLP down-projection (`blocks.5.mlp.fc2` by default)
starts creeping up at 40% of the run. Its amax and crest factor follow, the stale delayed scale lets a
few values overflow, the underflow fraction rises, the gradient norm gets spiky, the loss takes off and
the last step is non-finite: the run diverges. Later issues replace this with a real FP8 training run
with the agent attached.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Iterator
from urllib.parse import quote

import httpx
import msgpack
import numpy as np

from agent.wire import LOG2_HIST_BINS, LOG2_HIST_LO, SITES, TENSOR_STATS, WIRE_VERSION
from monitor.settings import Settings

E4M3_MAX, E4M3_MIN_SUB = 448.0, 2.0 ** -9
E5M2_MAX, E5M2_MIN_SUB = 57344.0, 2.0 ** -16
# The FP8 format of each site under the usual recipe; `output` and `grad_weight` are not cast to FP8.
SITE_FORMAT = {"input": (E4M3_MAX, E4M3_MIN_SUB), "weight": (E4M3_MAX, E4M3_MIN_SUB),
               "grad_output": (E5M2_MAX, E5M2_MIN_SUB)}


@dataclass
class DemoConfig:
    run: str
    steps: int = 300
    blocks: int = 8
    d_model: int = 512
    d_ff: int = 1408
    tokens_per_step: int = 8 * 512
    steps_per_batch: int = 10
    hist_every: int = 10
    seed: int = 0
    culprit: str = field(default="")

    def __post_init__(self):
        if self.steps < 20:
            raise ValueError("the demo needs at least 20 steps")
        if self.blocks < 1 or self.steps_per_batch < 1:
            raise ValueError("--blocks and --steps-per-batch must be at least 1")
        if not self.culprit:
            self.culprit = f"blocks.{min(5, self.blocks - 1)}.mlp.fc2"


class SyntheticRun:
    """Statistics of a fake FP8 run, computed from a small analytic model (no tensors are materialised)."""

    def __init__(self, cfg: DemoConfig):
        self.cfg = cfg
        d, f = cfg.d_model, cfg.d_ff
        shapes = {"attn.qkv": (d, 3 * d), "attn.out": (d, d), "mlp.fc1": (d, 2 * f), "mlp.fc2": (f, d)}
        self.layers = [f"blocks.{b}.{name}" for b in range(cfg.blocks) for name in shapes]
        if cfg.culprit not in self.layers:
            raise ValueError(f"culprit {cfg.culprit!r} is not one of the demo's layers")
        # One entry per (layer, site) tensor, in layer-major order.
        self.layer = [layer for layer in self.layers for _ in SITES]
        self.site = [site for _ in self.layers for site in SITES]
        rng = np.random.default_rng(cfg.seed)
        self.rng = rng
        n = len(self.layer)
        numel, rms, kurt = np.empty(n), np.empty(n), np.empty(n)
        for i, (layer, site) in enumerate(zip(self.layer, self.site)):
            d_in, d_out = shapes[layer.split(".", 2)[2]]
            block = int(layer.split(".")[1])
            numel[i] = {"input": cfg.tokens_per_step * d_in, "weight": d_in * d_out, "output": cfg.tokens_per_step * d_out,
                        "grad_output": cfg.tokens_per_step * d_out, "grad_weight": d_in * d_out}[site]
            rms[i] = {"input": 1.0, "weight": 0.02, "output": 0.6, "grad_output": 3e-6, "grad_weight": 2e-4}[site]
            rms[i] *= 1.0 + 0.08 * block
            kurt[i] = {"input": 4.0, "weight": 3.0, "output": 3.6, "grad_output": 6.0, "grad_weight": 4.5}[site]
            if layer.endswith("mlp.fc2") and site == "input":
                kurt[i] = 9.0  # SwiGLU outputs are heavy-tailed from the start
        self.numel = numel
        self.rms0 = rms * rng.lognormal(0.0, 0.05, n)
        self.kurt0 = kurt * rng.lognormal(0.0, 0.05, n)
        self.quantized = np.array([site in SITE_FORMAT for site in self.site])
        self.fmt_max = np.array([SITE_FORMAT.get(site, (np.nan, np.nan))[0] for site in self.site])
        self.fmt_min_sub = np.array([SITE_FORMAT.get(site, (np.nan, np.nan))[1] for site in self.site])
        self.amax_history = np.zeros(n)  # delayed scaling: max amax so far (history length > the run)
        # The story's clock.
        self.onset = int(0.4 * cfg.steps)
        self.divergence = cfg.steps - 1
        self.spike_start = self.divergence - max(5, cfg.steps // 12)
        self.tau = max(1.0, (self.divergence - self.onset) / math.log(1000.0 / 9.0))
        culprit = np.array([layer == cfg.culprit for layer in self.layer])
        fc2 = np.array([layer.endswith("mlp.fc2") for layer in self.layer])
        site = np.array(self.site)
        # How strongly each tensor follows the culprit's kurtosis growth (as an exponent of the growth).
        self.coupling = np.where(culprit & (site == "input"), 1.0,
                                 np.where(culprit & (site == "output"), 0.6,
                                          np.where(culprit & (site == "grad_output"), 0.3,
                                                   np.where(fc2 & (site == "input"), 0.12, 0.0))))

    def growth(self, step: int) -> float:
        """Kurtosis multiplier of the culprit tensor at `step` (1 before the onset)."""
        return math.exp(max(0, step - self.onset) / self.tau)

    def tensor_stats(self, step: int) -> tuple[dict[str, list], list]:
        cfg, rng, n = self.cfg, self.rng, len(self.layer)
        g = self.growth(step) ** self.coupling
        progress = step / cfg.steps
        kurt = self.kurt0 * g * rng.lognormal(0.0, 0.03, n)
        rms = self.rms0 * g ** 0.1 * rng.lognormal(0.0, 0.02, n)
        site = self.site
        rms = np.where(np.array(site) == "weight", rms * (1 + 0.25 * progress), rms)
        rms = np.where(np.array(site) == "grad_output", rms * (1 - 0.5 * progress), rms)
        mean = rms * 0.02 * rng.standard_normal(n)
        std = np.sqrt(rms ** 2 - mean ** 2)
        crest = 5.0 * np.sqrt(kurt / 3.0) * rng.lognormal(0.0, 0.03, n)
        amax = crest * rms
        kurt_central = kurt * (rms / std) ** 4
        outlier = np.minimum(1.0, 2e-9 + 2e-6 * (kurt - 3.0).clip(0))
        # Delayed scaling: the scale comes from the amax history before this step.
        first = self.amax_history == 0
        history = np.where(first, amax, self.amax_history)
        scale = self.fmt_max / history
        overflow = np.where(amax > history, outlier * (1.0 - history / amax), 0.0)
        # |s*x| < min_subnormal / 2 rounds to zero; a Gaussian core with heavy tails puts more mass there.
        underflow = np.minimum(1.0, math.sqrt(2 / math.pi) * (self.fmt_min_sub / 2) / (scale * std) * np.sqrt(kurt / 3))
        self.amax_history = np.maximum(history, amax)
        # Fractions of a tensor are counts over its element count.
        outlier, overflow, underflow = (np.round(frac * self.numel) / self.numel for frac in (outlier, overflow, underflow))
        nonfinite = np.zeros(n)
        if step == self.divergence:
            hit = self.coupling >= 0.3
            nonfinite[hit] = np.round(self.numel[hit] * 1e-3)
            rms = np.where(hit, np.nan, rms)
            std = np.where(hit, np.nan, std)
            mean = np.where(hit, np.nan, mean)
            kurt = np.where(hit, np.nan, kurt)
            kurt_central = np.where(hit, np.nan, kurt_central)
            crest = np.where(hit, np.nan, crest)
        columns = {
            "numel": self.numel, "amax": amax, "rms": rms, "mean": mean, "std": std, "kurtosis": kurt,
            "kurtosis_central": kurt_central, "crest": crest, "underflow_frac": underflow,
            "overflow_frac": overflow, "outlier_frac": outlier, "zero_frac": np.zeros(n), "nonfinite": nonfinite,
            "scale": scale, "amax_history_max": history,
        }
        stats = {}
        for name in TENSOR_STATS:
            values = columns[name].tolist()
            if name in ("numel", "nonfinite"):
                values = [int(v) for v in values]
            if name in ("scale", "underflow_frac", "overflow_frac", "amax_history_max"):
                values = [v if q else None for v, q in zip(values, self.quantized)]  # not an FP8 cast: not reported
            stats[name] = values
        hist = [None] * n
        if step % cfg.hist_every == 0:
            hist = [_log2_hist(self.numel[i], std[i], kurt[i]) if site[i] == "input" else None for i in range(n)]
        return stats, hist

    def scalars(self, step: int) -> dict[str, float]:
        cfg, rng = self.cfg, self.rng
        warmup = max(1, cfg.steps // 10)
        lr = 3e-3 * (step + 1) / warmup if step < warmup else \
            3e-4 + 0.5 * (3e-3 - 3e-4) * (1 + math.cos(math.pi * (step - warmup) / (cfg.steps - warmup)))
        loss = 2.9 + 7.5 * math.exp(-step / (0.12 * cfg.steps)) + 0.03 * rng.standard_normal()
        grad_norm = (0.35 + 2.0 * math.exp(-step / (0.05 * cfg.steps))) * rng.lognormal(0.0, 0.08)
        grad_norm *= 1.0 + 0.004 * (self.growth(step) - 1.0) * abs(rng.standard_normal())
        if step > self.spike_start:
            loss += 0.05 * math.exp((step - self.spike_start) / 5.0)
        if step == self.divergence:
            loss, grad_norm = math.nan, math.inf
        return {"loss": loss, "grad_norm": grad_norm, "lr": lr,
                "tokens_per_s": cfg.tokens_per_step / 0.034 * rng.lognormal(0.0, 0.02)}

    def run_meta(self) -> dict:
        cfg = self.cfg
        return {"config": {"arch": "llama", "precision": "fp8", "scaling": "delayed", "amax_history_len": 1024,
                           "n_layers": cfg.blocks, "d_model": cfg.d_model, "d_ff": cfg.d_ff,
                           "tokens_per_step": cfg.tokens_per_step, "steps": cfg.steps, "synthetic": True},
                "tags": {"source": "fp8mon demo", "story": f"kurtosis creep in {cfg.culprit}.input"}}

    def batches(self) -> Iterator[dict]:
        """Wire-format batches of `steps_per_batch` steps each; the last one marks the run diverged."""
        cfg = self.cfg
        for first in range(0, cfg.steps, cfg.steps_per_batch):
            steps = range(first, min(cfg.steps, first + cfg.steps_per_batch))
            t_step, t_layer, t_site, hist = [], [], [], []
            stats: dict[str, list] = {name: [] for name in TENSOR_STATS}
            s_step, s_name, s_value = [], [], []
            for step in steps:
                step_stats, step_hist = self.tensor_stats(step)
                t_step += [step] * len(self.layer)
                t_layer += self.layer
                t_site += self.site
                hist += step_hist
                for name in TENSOR_STATS:
                    stats[name] += step_stats[name]
                for name, value in self.scalars(step).items():
                    s_step.append(step)
                    s_name.append(name)
                    s_value.append(value)
            batch = {
                "version": WIRE_VERSION,
                "batch_id": f"steps-{steps[0]:07d}-{steps[-1]:07d}",
                "run": cfg.run,
                "tensors": {"step": t_step, "layer": t_layer, "site": t_site, "rank": 0, "stats": stats,
                            "log2_hist": hist if any(h is not None for h in hist) else None},
                "scalars": {"step": s_step, "name": s_name, "value": s_value},
                "sent_at": time.time(),
            }
            if first == 0:
                batch["run_meta"] = self.run_meta()
            if steps[-1] == cfg.steps - 1:
                batch.setdefault("run_meta", {})["status"] = "diverged"
            yield batch


_ERF = np.vectorize(math.erf)
_EDGES = 2.0 ** np.arange(LOG2_HIST_LO, LOG2_HIST_LO + LOG2_HIST_BINS + 1, dtype=np.float64)


def _log2_hist(numel: float, std: float, kurt: float) -> list[int] | None:
    """Counts of |x| per binade for a two-Gaussian mixture with roughly this std and kurtosis."""
    if not (math.isfinite(std) and math.isfinite(kurt)) or std <= 0:
        return None
    p = 1e-3
    ratio = max(1.0, math.sqrt(max(0.0, kurt / 3.0 - 1.0) / p))  # variance ratio of the outlier component
    core = std / math.sqrt(1 - p + p * ratio)
    cdf = (1 - p) * _ERF(_EDGES / (core * math.sqrt(2))) + p * _ERF(_EDGES / (core * math.sqrt(ratio) * math.sqrt(2)))
    mass = np.diff(cdf)
    mass[0] += cdf[0]  # the first bin also takes everything smaller
    mass[-1] += 1.0 - cdf[-1]  # and the last everything larger
    return np.round(mass * numel).astype(np.int64).tolist()


# -- the command ---------------------------------------------------------------------------------------


@dataclass
class FeedResult:
    batches: int = 0
    duplicates: int = 0
    tensor_records: int = 0
    scalar_records: int = 0
    values: int = 0
    run_id: int | None = None
    seconds: float = 0.0


def post_batch(client: httpx.Client, batch: dict, *, attempts: int = 8) -> dict:
    """POST one batch; a 503 or a transport error is retried with the same body (and so the same batch id)."""
    body = msgpack.packb(batch)
    delay = 0.2
    for attempt in range(attempts):
        try:
            response = client.post("/api/v1/ingest", content=body, headers={"content-type": "application/msgpack"})
        except httpx.TransportError:
            if attempt == attempts - 1:
                raise
        else:
            if response.status_code == 200:
                return response.json()
            if response.status_code != 503 or attempt == attempts - 1:
                raise RuntimeError(f"ingest of batch {batch['batch_id']} failed: "
                                   f"{response.status_code} {response.text[:500]}")
        time.sleep(delay)
        delay = min(delay * 2, 5.0)
    raise AssertionError("unreachable")


def feed(base_url: str, cfg: DemoConfig, *, token: str | None = None, delay: float = 0.0,
         stop: threading.Event | None = None, progress=None) -> FeedResult:
    result = FeedResult()
    started = time.perf_counter()
    headers = {"authorization": f"Bearer {token}"} if token else {}
    with httpx.Client(base_url=base_url, timeout=60.0, headers=headers) as client:
        for batch in SyntheticRun(cfg).batches():
            if stop is not None and stop.is_set():
                break
            answer = post_batch(client, batch)
            result.batches += 1
            result.duplicates += bool(answer["duplicate"])
            result.tensor_records += answer["tensor_records"]
            result.scalar_records += answer["scalar_records"]
            result.values += answer["values"]
            result.run_id = answer["run_id"]
            if progress is not None:
                progress(batch, answer)
            if delay:
                time.sleep(delay)
    result.seconds = time.perf_counter() - started
    return result


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
                links.insert(0, ("dashboard", f"{base}/"))
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

    from monitor.app import create_app
    from monitor.db import create_db_engine
    from monitor.migrate import current_revision, upgrade

    run = args.run or f"demo-fp8-{datetime.now():%Y%m%d-%H%M%S}"
    try:
        cfg = DemoConfig(run=run, steps=args.steps, blocks=args.blocks, steps_per_batch=args.steps_per_batch,
                         seed=args.seed)
        SyntheticRun(cfg)  # validates the configuration before anything starts
    except ValueError as exc:
        print(f"fp8mon demo: {exc}", file=sys.stderr)
        return 2

    engine = create_db_engine(settings.database_url)
    try:
        upgrade(engine)
        db = engine.url.render_as_string(hide_password=True)
        print(f"database {db} at schema revision {current_revision(engine)}", flush=True)
    finally:
        engine.dispose()

    port_given = args.port is not None or "FP8MON_PORT" in os.environ
    try:
        sock = _bind(settings.host, settings.port, fallback=not port_given)
    except OSError as exc:
        print(f"fp8mon demo: cannot listen on {settings.host}:{settings.port}: {exc}", file=sys.stderr)
        return 2
    host = f"[{settings.host}]" if ":" in settings.host else settings.host
    shown = "127.0.0.1" if settings.host in ("0.0.0.0", "") else host
    base = f"http://{shown}:{sock.getsockname()[1]}"
    token = settings.write_tokens[0] if settings.write_tokens else None

    app = create_app(settings)
    server = uvicorn.Server(uvicorn.Config(app, log_level=args.log_level, access_log=False, lifespan="on"))
    outcome: dict = {}
    stop = threading.Event()

    def progress(batch: dict, answer: dict) -> None:
        last = batch["scalars"]["step"][-1]
        if (last + 1) % max(cfg.steps_per_batch, cfg.steps // 5) < cfg.steps_per_batch or last == cfg.steps - 1:
            tag = " (already stored)" if answer["duplicate"] else ""
            print(f"  step {last + 1:>5}/{cfg.steps}: {answer['values']:>7} values in batch "
                  f"{batch['batch_id']}{tag}", flush=True)

    def feeder() -> None:
        while not server.started:
            if stop.is_set() or server.should_exit:
                return
            time.sleep(0.02)
        print(f"feeding synthetic FP8 run {run!r} ({len(SyntheticRun(cfg).layers)} layers x {len(SITES)} sites, "
              f"{cfg.steps} steps) into {base}/api/v1/ingest", flush=True)
        try:
            result = feed(base, cfg, token=token, delay=args.delay, stop=stop, progress=progress)
        except Exception as exc:  # report and stop the server: the demo failed
            outcome["error"] = f"{type(exc).__name__}: {exc}"
            print(f"fp8mon demo: feeding failed: {outcome['error']}", file=sys.stderr, flush=True)
            server.should_exit = True
            return
        outcome["result"] = result
        rate = result.values / result.seconds if result.seconds else 0.0
        print(f"fed {result.batches} batches ({result.duplicates} already stored): {result.tensor_records} tensor "
              f"records, {result.scalar_records} scalar records, {result.values} values in {result.seconds:.1f} s "
              f"({rate:,.0f} values/s)", flush=True)
        print(f"run {run!r} (id {result.run_id}); the story: kurtosis of {cfg.culprit}.input creeps up from "
              f"step {SyntheticRun(cfg).onset}, the loss diverges at step {cfg.steps - 1}", flush=True)
        reader = (settings.read_tokens or settings.write_tokens or [None])[0]
        with httpx.Client(base_url=base, timeout=10.0,
                          headers={"authorization": f"Bearer {reader}"} if reader else {}) as client:
            links = _links(app, client, base, run, result.run_id)
        for label, url in links:
            print(f"  {label:<36} {url}", flush=True)
        if args.exit_after_feed:
            server.should_exit = True
        else:
            print("serving until Ctrl-C", flush=True)

    thread = threading.Thread(target=feeder, name="fp8mon-demo-feeder", daemon=True)
    thread.start()
    print(f"fp8mon monitor listening on {base}", flush=True)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        pass
    finally:
        stop.set()
        sock.close()
    thread.join(timeout=5)
    if "error" in outcome:
        return 1
    if args.exit_after_feed and "result" not in outcome:
        print("fp8mon demo: the server stopped before the feed finished", file=sys.stderr)
        return 1
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--database-url", help="SQLAlchemy URL (env FP8MON_DATABASE_URL); default: a SQLite file "
                                               "under ./.fp8mon/, created and migrated")
    parser.add_argument("--host", help="bind address (env FP8MON_HOST; default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="port (env FP8MON_PORT; default 8080, or a free one if 8080 is "
                                                  "busy and no port was asked for; 0: any free port)")
    parser.add_argument("--run", help="run name (default demo-fp8-<date>-<time>); the same name again re-sends "
                                      "the same batch ids, which the server recognises as already stored")
    parser.add_argument("--steps", type=int, default=300, help="training steps to simulate (default 300)")
    parser.add_argument("--blocks", type=int, default=8, help="transformer blocks, 4 linears each (default 8)")
    parser.add_argument("--steps-per-batch", type=int, default=10, help="steps per ingest batch (default 10)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--delay", type=float, default=0.0, help="seconds to wait between batches, to watch it live")
    parser.add_argument("--exit-after-feed", action="store_true", help="stop the server once the run is fed "
                                                                       "(for tests and scripts)")
    parser.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"])
