"""Creating SQLAlchemy engines from the URLs users give, hiding their secrets, and
translating the errors the database raises."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any
from urllib.parse import quote

import psycopg2
import psycopg2.extensions
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError, DBAPIError, InvalidatePoolError, SQLAlchemyError
from sqlalchemy.pool import NullPool

from outbox_kafka.errors import ConfigurationError, OutboxError, StorageError

#: What every command and the relay say when no database URL was given.
NO_DATABASE_URL = "no database URL given (--database-url or OUTBOX_DATABASE_URL)"
#: SQLSTATE undefined_table: the outbox's tables are not there.
_UNDEFINED_TABLE = "42P01"


def normalise_url(url: str) -> str:
    """The URL to connect with psycopg2, the driver the relay and the commands use.

    Accepts libpq-style URLs (``postgres://``, ``postgresql://``) and any
    ``postgresql+<driver>://`` URL an application already has (``+psycopg``,
    ``+asyncpg``, ...): the driver is replaced by psycopg2, the rest is kept.
    Query parameters must then be libpq's; another driver's (asyncpg's ``ssl``,
    for one) is refused here, naming it, rather than at every connection attempt.
    """
    if not url:
        raise ConfigurationError(NO_DATABASE_URL)
    for prefix in ("postgres://", "postgresql://"):
        if url.startswith(prefix):
            url = "postgresql+psycopg2://" + url[len(prefix) :]
            break
    try:
        parsed = make_url(url)
    except (ArgumentError, ValueError) as exc:
        raise ConfigurationError(f"invalid database URL {redact_url(url)}: {exc}") from None
    if parsed.get_backend_name() != "postgresql":
        raise ConfigurationError(
            f"not a PostgreSQL URL: {redact_url(url)} (expected postgresql://...)"
        )
    driver = parsed.get_driver_name()
    for key in parsed.query:
        try:
            psycopg2.extensions.parse_dsn(f"{key}=x")
        except psycopg2.ProgrammingError:
            raise ConfigurationError(
                f"database URL parameter {key!r} is not a libpq parameter: outbox-kafka "
                f"connects with psycopg2 (libpq) whatever the URL's driver ({driver}); "
                "use libpq's, e.g. sslmode=require"
            ) from None
    if driver == "psycopg2":
        return url
    return parsed.set(drivername="postgresql+psycopg2").render_as_string(hide_password=False)


#: libpq parameters that hold secrets when given in the URL's query string.
_SECRET_QUERY_KEYS = frozenset({"password", "sslpassword"})


def redact_url(url: str) -> str:
    """The URL with any password replaced by ``***``, safe for logs."""
    try:
        parsed = make_url(url.replace("postgres://", "postgresql://", 1))
    except (ArgumentError, ConfigurationError, ValueError):
        return "<unparseable database URL>"
    hidden = {k: "redacted" for k in parsed.query if k.lower() in _SECRET_QUERY_KEYS}
    return parsed.update_query_dict(hidden).render_as_string(hide_password=True)


def url_secrets(url: str) -> list[str]:
    """The secrets a database URL holds (password, also percent-encoded), for log scrubbing."""
    try:
        parsed: URL = make_url(url.replace("postgres://", "postgresql://", 1))
    except (ArgumentError, ValueError):
        return []
    values = [str(parsed.password)] if parsed.password else []
    for key, value in parsed.query.items():
        if key.lower() in _SECRET_QUERY_KEYS:
            values.extend([value] if isinstance(value, str) else value)
    return [*values, *(quote(v, safe="") for v in values if quote(v, safe="") != v)]


def make_engine(url: str, *, ping_after_idle: float | None = None, **kwargs: Any) -> Engine:
    """An engine for ``url`` that checks a pooled connection before each use.

    With ``ping_after_idle``, connections checked out inside :func:`unchecked_when_fresh`
    skip the check when they were used less than that many seconds before.
    """
    try:
        engine = create_engine(normalise_url(url), pool_pre_ping=ping_after_idle is None, **kwargs)
    except (ArgumentError, ValueError) as exc:
        raise ConfigurationError(f"invalid database URL {redact_url(url)}: {exc}") from None
    if ping_after_idle is not None:
        _ping_unless_fresh(engine, ping_after_idle)
    return engine


#: Set inside :func:`unchecked_when_fresh`, for the thread (or task) that set it.
_UNCHECKED_WHEN_FRESH: ContextVar[bool] = ContextVar("outbox_unchecked_when_fresh", default=False)


@contextlib.contextmanager
def unchecked_when_fresh() -> Iterator[None]:
    """Connections checked out in this block from an engine made with ``ping_after_idle``
    go out without a check when they were used within that many seconds.

    For a loop of short transactions that retries a statement that fails: a check
    is a round trip before each transaction, and a connection handed back a moment
    ago is as good as the statement that just ran on it. One that broke since (a
    restarted server) fails its first statement, as a connection may mid-use, and
    the loop retries on a new one.
    """
    token = _UNCHECKED_WHEN_FRESH.set(True)
    try:
        yield
    finally:
        _UNCHECKED_WHEN_FRESH.reset(token)


def _ping_unless_fresh(engine: Engine, seconds: float) -> None:
    """Check pooled connections before use as ``pool_pre_ping`` does, except fresh ones
    inside :func:`unchecked_when_fresh`; a dead one is replaced, and so is every
    connection of the pool older than it, as ``pool_pre_ping`` does."""
    pool = engine.pool
    dialect = engine.dialect

    def checked_in(dbapi_connection: Any, record: Any) -> None:
        record.info["idle_since"] = time.monotonic()

    def checked_out(dbapi_connection: Any, record: Any, proxy: Any) -> None:
        idle_since = record.info.get("idle_since")
        if idle_since is None:
            return  # connected for this checkout: nothing to check
        if _UNCHECKED_WHEN_FRESH.get() and time.monotonic() - idle_since < seconds:
            return
        try:
            alive = dialect.do_ping(dbapi_connection)
        except Exception as exc:
            raise InvalidatePoolError(f"pooled connection failed its check: {exc}") from exc
        if not alive:
            raise InvalidatePoolError("pooled connection failed its check")

    event.listen(pool, "checkin", checked_in)
    event.listen(pool, "checkout", checked_out)


def short_command_engine(url: str, *, connect_timeout: float = 10.0) -> Engine:
    """An engine for one short command: no pool kept, a bounded connection wait."""
    # READ COMMITTED whatever the server's default: requeue and unpark lock
    # rows in one statement and read what they hold in the next.
    return make_engine(
        url,
        poolclass=NullPool,
        isolation_level="READ COMMITTED",
        connect_args={"connect_timeout": max(1, round(connect_timeout))},
    )


def _driver_cause(error: BaseException | None) -> str:
    cause = str(error).strip()
    if getattr(error, "pgcode", None) == _UNDEFINED_TABLE:
        cause += " (run outbox-kafka migrate first)"
    return cause


@contextlib.contextmanager
def storage_errors(what: str, *, error: type[OutboxError] = StorageError) -> Iterator[None]:
    """Raise database errors from the block as ``error("<what> failed: <cause>")``.

    The cause is the driver's message (SQLAlchemy's when no driver error is
    behind it); a missing table adds that the outbox needs migrating.
    """
    try:
        yield
    except DBAPIError as exc:
        raise error(f"{what} failed: {_driver_cause(exc.orig)}") from exc
    except SQLAlchemyError as exc:
        raise error(f"{what} failed: {exc}") from exc
    except psycopg2.Error as exc:
        raise error(f"{what} failed: {_driver_cause(exc)}") from exc
