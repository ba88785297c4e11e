"""Creating SQLAlchemy engines from the URLs users give, and hiding their secrets."""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

from sqlalchemy import Engine, create_engine
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError

from outbox_kafka.errors import ConfigurationError

#: What every command and the relay say when no database URL was given.
NO_DATABASE_URL = "no database URL given (--database-url or OUTBOX_DATABASE_URL)"


def normalise_url(url: str) -> str:
    """Accept libpq-style URLs (``postgres://``, ``postgresql://``) for psycopg2."""
    if not url:
        raise ConfigurationError(NO_DATABASE_URL)
    for prefix in ("postgres://", "postgresql://"):
        if url.startswith(prefix):
            return "postgresql+psycopg2://" + url[len(prefix) :]
    return url


#: libpq parameters that hold secrets when given in the URL's query string.
_SECRET_QUERY_KEYS = frozenset({"password", "sslpassword"})


def redact_url(url: str) -> str:
    """The URL with any password replaced by ``***``, safe for logs."""
    try:
        parsed = make_url(normalise_url(url))
    except (ArgumentError, ConfigurationError, ValueError):
        return "<unparseable database URL>"
    hidden = {k: "redacted" for k in parsed.query if k.lower() in _SECRET_QUERY_KEYS}
    return parsed.update_query_dict(hidden).render_as_string(hide_password=True)


def url_secrets(url: str) -> list[str]:
    """The secrets a database URL holds (password, also percent-encoded), for log scrubbing."""
    try:
        parsed: URL = make_url(normalise_url(url))
    except (ArgumentError, ConfigurationError, ValueError):
        return []
    values = [str(parsed.password)] if parsed.password else []
    for key, value in parsed.query.items():
        if key.lower() in _SECRET_QUERY_KEYS:
            values.extend([value] if isinstance(value, str) else value)
    return [*values, *(quote(v, safe="") for v in values if quote(v, safe="") != v)]


def make_engine(url: str, **kwargs: Any) -> Engine:
    """An engine for ``url`` that checks connections before use."""
    try:
        return create_engine(normalise_url(url), pool_pre_ping=True, **kwargs)
    except (ArgumentError, ValueError) as exc:
        raise ConfigurationError(f"invalid database URL {redact_url(url)}: {exc}") from None
