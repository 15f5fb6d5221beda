# The fp8mon monitor server (no torch: the monitor only needs agent/wire.py's names).
#   docker build -t fp8mon .    (docker-compose.yml builds it for you)
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /src
COPY pyproject.toml README.md ./
# Exact versions of every dependency (scripts/lock_monitor.py writes it from a working environment).
COPY requirements/monitor.lock ./requirements/monitor.lock
COPY agent ./agent
COPY monitor ./monitor
COPY migrations ./migrations
COPY trainer ./trainer
COPY fp8mon ./fp8mon
RUN pip install -c requirements/monitor.lock ".[monitor]" && rm -rf /src/build

RUN useradd --system --create-home --home-dir /data --uid 10001 fp8mon
USER fp8mon
WORKDIR /data

# Without FP8MON_DATABASE_URL the server uses a SQLite file in /data/.fp8mon/. Serving on 0.0.0.0 needs tokens
# (FP8MON_WRITE_TOKENS, FP8MON_READ_TOKENS) or FP8MON_ALLOW_OPEN=true.
ENV FP8MON_HOST=0.0.0.0 \
    FP8MON_PORT=8080
EXPOSE 8080
HEALTHCHECK --interval=10s --timeout=3s --start-period=20s \
  CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8080/healthz', timeout=2)"]
CMD ["sh", "-c", "fp8mon db upgrade && exec fp8mon serve --host 0.0.0.0"]
