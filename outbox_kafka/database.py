"""Creating SQLAlchemy engines from the URLs users give, hiding their secrets, and
translating the errors the database raises."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import psycopg2
import psycopg2.extensions
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError, DBAPIError, DisconnectionError, SQLAlchemyError
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
    """An engine for ``url`` that checks connections before use: every time, or with
    ``ping_after_idle``, only those that were idle in the pool that many seconds."""
    try:
        engine = create_engine(normalise_url(url), pool_pre_ping=ping_after_idle is None, **kwargs)
    except (ArgumentError, ValueError) as exc:
        raise ConfigurationError(f"invalid database URL {redact_url(url)}: {exc}") from None
    if ping_after_idle is not None:
        _ping_after_idle(engine, ping_after_idle)
    return engine


def _ping_after_idle(engine: Engine, seconds: float) -> None:
    """Check a pooled connection before use only when it has been idle ``seconds``.

    A connection handed back a moment ago is as good as the statement that just
    ran on it: checking it costs a round trip before each transaction, which a
    loop of short transactions pays on every one. One that sat idle longer may
    have been dropped (a restarted server, a proxy's idle timeout): it is
    checked, and replaced if dead, as ``pool_pre_ping`` would. A connection that
    breaks within ``seconds`` fails its statement, as any connection may mid-use.
    """
    pool = engine.pool
    dialect = engine.dialect

    def checked_in(dbapi_connection: Any, record: Any) -> None:
        record.info["idle_since"] = time.monotonic()

    def checked_out(dbapi_connection: Any, record: Any, proxy: Any) -> None:
        idle_since = record.info.get("idle_since")
        if idle_since is None or time.monotonic() - idle_since < seconds:
            return
        try:
            alive = dialect.do_ping(dbapi_connection)
        except Exception as exc:
            raise DisconnectionError(f"pooled connection failed its check: {exc}") from exc
        if not alive:
            raise DisconnectionError("pooled connection failed its check")

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
