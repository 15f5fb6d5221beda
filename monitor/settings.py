"""Server settings: FP8MON_* environment variables, overridden by command-line flags."""

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

DEFAULT_DB_PATH = Path(".fp8mon") / "fp8mon.db"


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
