"""Loads the named SQL statements of ``sql/queries.sql`` and the migrations.

Statements are kept in SQL files, one per ``-- name:`` block, and rendered
once per outbox with its quoted table names.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cache
from importlib import resources

from sqlalchemy import TextClause, text
from sqlalchemy.dialects.postgresql.psycopg2 import PGDialect_psycopg2

from outbox_kafka.naming import TableNames

_NAME = re.compile(r"^-- name: (\w+)\s*$", re.MULTILINE)
_PLACEHOLDER = re.compile(r"\{(\w+)\}")
_MIGRATION_FILE = re.compile(r"(\d{4})_(\w+)\.sql")
_PSYCOPG2 = PGDialect_psycopg2()  # type: ignore[no-untyped-call]


def _sql_file(*parts: str) -> str:
    return (
        resources.files("outbox_kafka.schema").joinpath("sql", *parts).read_text(encoding="utf-8")
    )


@cache
def raw_queries() -> dict[str, str]:
    """Every named statement, unrendered, keyed by name."""
    source = _sql_file("queries.sql")
    chunks = _NAME.split(source)
    queries: dict[str, str] = {}
    for name, body in zip(chunks[1::2], chunks[2::2], strict=True):
        if name in queries:
            raise RuntimeError(f"query {name!r} is defined twice in queries.sql")
        # Comments stay in the file for readers; statements are sent without them.
        lines = [line for line in body.splitlines() if not line.lstrip().startswith("--")]
        queries[name] = "\n".join(lines).strip()
    return queries


def render(sql: str, names: TableNames) -> str:
    """Substitute the ``{name}`` placeholders; unknown braces are left alone."""
    values = names.placeholders()
    return _PLACEHOLDER.sub(lambda m: values.get(m.group(1), m.group(0)), sql)


ArrayElement = str | bytes | int | float | bool | None


def _array_element(value: ArrayElement) -> str:
    if value is None:
        return "NULL"
    if value is True:
        return "t"
    if value is False:
        return "f"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, bytes):
        return '"\\\\x' + value.hex() + '"'
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def pg_array(values: Sequence[ArrayElement]) -> str:
    """A PostgreSQL array literal, e.g. ``{"a",NULL,3}``.

    Bound as one string, an array is parsed by the server in one go; the
    ``ARRAY[...]`` expression psycopg2 builds from a list has to be parsed and
    folded by the planner element by element, which at hundreds of elements
    costs more than the statement itself.
    """
    return "{" + ",".join(map(_array_element, values)) + "}"


def pg_text_array(values: Sequence[str]) -> str:
    """:func:`pg_array` of strings, in a few passes over one string rather than per element.

    The strings are joined with NUL, escaped in one go, and the NULs become
    the separators. PostgreSQL text cannot hold NUL, so callers pass strings
    without it; a list with one anyway takes the general path (and the server
    refuses it).
    """
    if not values:
        return "{}"
    joined = "\x00".join(values)
    if joined.count("\x00") != len(values) - 1:
        return pg_array(values)
    escaped = joined.replace("\\", "\\\\").replace('"', '\\"').replace("\x00", '","')
    return '{"' + escaped + '"}'


def pg_int_array(values: Iterable[int | None]) -> str:
    """:func:`pg_array` of integers (and NULLs), in one pass: no quoting needed."""
    return "{" + ",".join(["NULL" if v is None else str(v) for v in values]) + "}"


def millis(seconds: float) -> str:
    """``seconds`` as whole milliseconds (at least 1), for a timeout setting."""
    return str(max(1, round(seconds * 1000)))


@dataclass(frozen=True)
class Migration:
    """One versioned migration; ``adopt_sql`` is what adopting tables made without it runs.

    Tables made from :mod:`outbox_kafka.schema.metadata` (by Alembic, say) have the
    latest shape but none of what the migrations add beyond it: storage
    settings, functions, grants. A migration whose file creates or alters
    tables comes with ``NNNN_name.adopt.sql``, holding only those additions;
    a migration without one adds nothing but them and is run as it is.
    """

    version: int
    name: str
    sql: str
    adopt_sql: str


@cache
def raw_migrations() -> tuple[Migration, ...]:
    """The versioned migrations, in order, unrendered."""
    folder = resources.files("outbox_kafka.schema").joinpath("sql", "migrations")
    found = []
    for entry in folder.iterdir():
        match = _MIGRATION_FILE.fullmatch(entry.name)
        if match:
            sql = entry.read_text(encoding="utf-8")
            adopt = folder.joinpath(entry.name.removesuffix(".sql") + ".adopt.sql")
            adopt_sql = adopt.read_text(encoding="utf-8") if adopt.is_file() else sql
            found.append(Migration(int(match.group(1)), match.group(2), sql, adopt_sql))
    found.sort(key=lambda m: m.version)
    versions = [m.version for m in found]
    if versions != list(range(1, len(found) + 1)):
        raise RuntimeError(f"migrations must be numbered 1..n without gaps, found {versions}")
    return tuple(found)


class Queries:
    """The named statements of one outbox, rendered and ready to execute."""

    def __init__(self, names: TableNames) -> None:
        self.names = names
        self.sql = {name: render(body, names) for name, body in raw_queries().items()}
        self._text = {name: text(body) for name, body in self.sql.items()}
        self._driver: dict[str, str] = {}

    def __getitem__(self, name: str) -> TextClause:
        return self._text[name]

    def driver_sql(self, name: str) -> str:
        """The statement in psycopg2's ``%(name)s`` style, for the relay's hot path."""
        cached = self._driver.get(name)
        if cached is None:
            compiled = self._text[name].compile(dialect=_PSYCOPG2)
            cached = self._driver[name] = str(compiled)
        return cached

    def driver_batch(self, *names: str) -> str:
        """Several statements in psycopg2's style, sent as one string: one round trip,
        each statement run in turn (its own snapshot under READ COMMITTED); the
        driver returns the last one's rows."""
        return ";\n".join(self.driver_sql(name) for name in names)

    def migrations(self) -> list[Migration]:
        return [
            Migration(m.version, m.name, render(m.sql, self.names), render(m.adopt_sql, self.names))
            for m in raw_migrations()
        ]


@cache
def queries_for(names: TableNames) -> Queries:
    return Queries(names)
