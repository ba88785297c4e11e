"""Creating SQLAlchemy engines from the URLs users give, and hiding their secrets."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Engine, create_engine
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError

from .errors import ConfigurationError


def normalise_url(url: str) -> str:
    """Accept libpq-style URLs (``postgres://``, ``postgresql://``) for psycopg2."""
    if not url:
        raise ConfigurationError("no database URL given (--database-url or OUTBOX_DATABASE_URL)")
    for prefix in ("postgres://", "postgresql://"):
        if url.startswith(prefix):
            return "postgresql+psycopg2://" + url[len(prefix) :]
    return url


def redact_url(url: str) -> str:
    """The URL with any password replaced by ``***``, safe for logs."""
    try:
        return make_url(normalise_url(url)).render_as_string(hide_password=True)
    except (ArgumentError, ConfigurationError, ValueError):
        return "<unparseable database URL>"


def make_engine(url: str, **kwargs: Any) -> Engine:
    """An engine for ``url`` that checks connections before use."""
    try:
        return create_engine(normalise_url(url), pool_pre_ping=True, **kwargs)
    except (ArgumentError, ValueError) as exc:
        raise ConfigurationError(f"invalid database URL {redact_url(url)}: {exc}") from None
