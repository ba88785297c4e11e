"""Several outboxes for one relay process: the outboxes file and each outbox's settings.

The file is TOML, one table per outbox under ``outboxes``::

    [outboxes.orders]
    database_url_env = "ORDERS_DATABASE_URL"   # or database_url = "postgresql://..."

    [outboxes.tenant_a]
    database_url_env = "TENANTS_DATABASE_URL"
    schema = "tenant_a"                        # default: --db-schema
    table = "outbox"                           # default: --table

An entry without a database URL uses ``--database-url``. Every other relay
setting is shared by all the outboxes.
"""

from __future__ import annotations

import dataclasses
import os
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from outbox_kafka.database import normalise_url
from outbox_kafka.errors import ConfigurationError
from outbox_kafka.naming import TableNames
from outbox_kafka.relay.settings import RelaySettings

#: An outbox's name: a metrics label value and part of log lines, so short and plain.
_NAME = re.compile(r"[a-z][a-z0-9_-]{0,62}")
_KEYS = frozenset({"database_url", "database_url_env", "schema", "table"})


@dataclass(frozen=True)
class OutboxTarget:
    """One outbox a relay serves: a name, a database and a table."""

    name: str
    database_url: str = field(repr=False)  # may hold a password
    table: str
    db_schema: str

    @property
    def names(self) -> TableNames:
        return TableNames(self.table, self.db_schema)


def load_outboxes(
    path: str | Path, *, database_url: str | None, table: str, db_schema: str
) -> list[OutboxTarget]:
    """The outboxes of the file at ``path``; the keyword arguments are the defaults.

    Refuses, naming the entry and the problem: an unreadable file, an unknown
    key, a bad name, an entry with no database URL, a variable that is not
    set, and two entries for one table of one database.
    """
    try:
        document = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigurationError(f"cannot read the outboxes file {path}: {exc}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigurationError(f"the outboxes file {path} is not TOML: {exc}") from None
    unknown = set(document) - {"outboxes"}
    entries = document.get("outboxes")
    if unknown or not isinstance(entries, dict) or not entries:
        raise ConfigurationError(
            f"the outboxes file {path} must hold [outboxes.<name>] tables and nothing else"
        )
    targets = [
        _target(str(name), entry, database_url, table, db_schema) for name, entry in entries.items()
    ]
    seen: dict[tuple[str, str, str], str] = {}
    for target in targets:
        where = (normalise_url(target.database_url), target.db_schema, target.table)
        other = seen.setdefault(where, target.name)
        if other != target.name:
            raise ConfigurationError(
                f"outboxes {other!r} and {target.name!r} are the same table "
                f"{target.names.qualified_events} of one database"
            )
    return targets


def _target(
    name: str, entry: Any, database_url: str | None, table: str, db_schema: str
) -> OutboxTarget:
    if not _NAME.fullmatch(name):
        raise ConfigurationError(
            f"outbox name {name!r}: use lowercase letters, digits, '_' and '-', "
            "starting with a letter, at most 63 characters"
        )
    if not isinstance(entry, dict):
        raise ConfigurationError(f"outbox {name!r}: expected a table of settings")
    unknown = set(entry) - _KEYS
    if unknown:
        raise ConfigurationError(
            f"outbox {name!r}: unknown key(s) {sorted(unknown)}; known: {sorted(_KEYS)}"
        )
    for key, value in entry.items():
        if not isinstance(value, str) or not value:
            raise ConfigurationError(f"outbox {name!r}: {key} must be a non-empty string")
    if "database_url" in entry and "database_url_env" in entry:
        raise ConfigurationError(
            f"outbox {name!r}: give database_url or database_url_env, not both"
        )
    url = entry.get("database_url") or database_url
    variable = entry.get("database_url_env")
    if variable is not None:
        url = os.environ.get(variable)
        if not url:
            raise ConfigurationError(
                f"outbox {name!r}: the variable {variable} (its database_url_env) is not set"
            )
    if not url:
        raise ConfigurationError(
            f"outbox {name!r} has no database URL: give database_url or database_url_env "
            "in its entry, or --database-url for every entry without one"
        )
    target = OutboxTarget(
        name=name,
        database_url=url,
        table=entry.get("table", table),
        db_schema=entry.get("schema", db_schema),
    )
    try:
        target.names  # noqa: B018 - validates the identifiers
    except ConfigurationError as exc:
        raise ConfigurationError(f"outbox {name!r}: {exc}") from None
    return target


def settings_for(shared: RelaySettings, target: OutboxTarget) -> RelaySettings:
    """The settings of the relay loop serving ``target``: ``shared`` with its database and table.

    Its relay id gets the outbox's name, so the loops of one process tell apart in leases and logs.
    """
    return dataclasses.replace(
        shared,
        database_url=target.database_url,
        table=target.table,
        db_schema=target.db_schema,
        relay_id=f"{shared.relay_id}/{target.name}",
    )
