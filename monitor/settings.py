"""Server settings: FP8MON_* environment variables, overridden by command-line flags."""

import json
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

DEFAULT_DB_PATH = Path(".fp8mon") / "fp8mon.db"
DEFAULT_PREDICTOR = "fp8mon.monitor.predictors:RunPredictor"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="FP8MON_", extra="ignore")

    database_url: str = Field(
        default=f"sqlite:///{DEFAULT_DB_PATH}",
        description="SQLAlchemy URL: sqlite:///path.db (default) or postgresql+psycopg://user@host/db",
    )
    host: str = "127.0.0.1"
    port: int = Field(default=8080, ge=0, le=65535)
    workers: int = Field(default=1, ge=1, le=64)
    max_request_bytes: int = Field(
        default=32 * 1024 * 1024, ge=1024, description="largest accepted request body, after gzip inflation"
    )
    write_tokens: list[str] = Field(default_factory=list, description="tokens allowed to ingest; empty: no auth")
    read_tokens: list[str] = Field(default_factory=list, description="tokens allowed to query; empty: no auth")
    db_pool_size: int = Field(default=8, ge=1)
    stall_intervals: float = Field(default=5.0, gt=0, description="a running run that sent nothing for this many of "
                                                                  "its usual reporting intervals reads as stalled")
    stall_min_seconds: float = Field(default=60.0, ge=0, description="... and for at least this many seconds")
    rollup_interval_s: float = Field(default=2.0, ge=0, description="seconds between the background compaction "
                                                                    "passes that fill the rollups; 0: none")

    # -- predictions, alerts, webhooks, Prometheus ---------------------------------------------------
    # (no None defaults: `fp8mon serve` exports every setting to its workers as a string)
    predictor: str = Field(default=DEFAULT_PREDICTOR,
                           description="module:callable building a run's predictor, called as f(run, config); "
                                       "empty: no predictions (alerts then come from nothing)")
    predictor_queue_size: int = Field(default=1000, ge=1,
                                      description="ingested batches waiting for the predictors; when full, batches "
                                                  "skip prediction (counted), ingest never waits")
    prediction_every_steps: int = Field(default=10, ge=1,
                                        description="store a prediction every N steps, plus the last of each batch "
                                                    "and any whose risk moved by prediction_risk_delta")
    prediction_risk_delta: float = Field(default=0.05, ge=0)
    webhook_urls: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="comma-separated (or JSON list) URLs that receive alert notifications "
                                          "(Slack-compatible JSON) when an alert fires, escalates or resolves")
    webhook_max_attempts: int = Field(default=6, ge=1, le=20)
    webhook_backoff_seconds: float = Field(default=0.5, ge=0, description="first retry delay; doubles per attempt")
    webhook_max_backoff_seconds: float = Field(default=30.0, ge=0)
    webhook_timeout_seconds: float = Field(default=5.0, gt=0)
    webhook_min_severity: Literal["info", "warning", "critical"] = Field(
        default="warning", description="webhook notifications only for alerts of this severity or higher")
    webhook_group_wait_seconds: float = Field(
        default=10.0, ge=0, description="a run and rule's first notification waits this long to gather the "
                                        "alerts of its other layers and sites into one message")
    webhook_group_interval_seconds: float = Field(
        default=300.0, ge=0, description="rate limit: at most one webhook notification per run and rule this often "
                                         "(what changed meanwhile comes in the next one)")
    alertmanager_url: str = Field(default="", description="Alertmanager's base URL (http://alertmanager:9093): "
                                                          "alerts are posted to its v2 API; empty: not used")
    alertmanager_resend_seconds: float = Field(default=60.0, gt=0,
                                               description="firing alerts are re-posted this often (Alertmanager "
                                                           "lets them expire after four missed re-sends)")
    public_url: str = Field(default="", description="base URL of this server in webhook links; default "
                                                    "http://host:port")
    metrics_max_runs: int = Field(default=100, ge=1, description="runs exported at /metrics: the most recently "
                                                                 "active ones")
    metrics_run_grace_seconds: float = Field(default=300.0, ge=0,
                                             description="how long an ended run's series stay at /metrics")

    @field_validator("webhook_urls", mode="before")
    @classmethod
    def _url_list(cls, value):
        if isinstance(value, str):
            text = value.strip()
            if text.startswith("["):
                return json.loads(text)
            return [part.strip() for part in text.split(",") if part.strip()]
        return value

    @field_validator("webhook_urls")
    @classmethod
    def _http_urls(cls, urls: list[str]) -> list[str]:
        for url in urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"webhook URL {url!r} must start with http:// or https://")
        return urls

    @field_validator("alertmanager_url")
    @classmethod
    def _http_url(cls, url: str) -> str:
        if url and not url.startswith(("http://", "https://")):
            raise ValueError(f"Alertmanager URL {url!r} must start with http:// or https://")
        return url

    def base_url(self) -> str:
        if self.public_url:
            return self.public_url.rstrip("/")
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host
        return f"http://{host}:{self.port}"
