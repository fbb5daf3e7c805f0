"""Database settings: the only place the farm's database configuration is read from the environment."""

from __future__ import annotations

from pydantic_settings import BaseSettings, SettingsConfigDict

DEFAULT_DATABASE_URL = "postgresql+psycopg2://postgres@127.0.0.1:5432/tunefarm"
"""A local PostgreSQL with trust authentication (development and tests)."""


class DatabaseSettings(BaseSettings):
    """How a farm process reaches PostgreSQL. Environment: TUNEFARM_DATABASE_URL, ...

    A service's own settings class embeds these fields by inheriting from this class.
    """

    model_config = SettingsConfigDict(env_prefix="TUNEFARM_", extra="ignore")

    # SQLAlchemy URL of the farm database (driver psycopg2).
    database_url: str = DEFAULT_DATABASE_URL
    # Connections kept open per process, and extra ones allowed under load.
    database_pool_size: int = 5
    database_max_overflow: int = 10
    # Seconds to wait for a free pooled connection before failing.
    database_pool_timeout: float = 30.0
    # Log every SQL statement (debugging only).
    database_echo: bool = False
