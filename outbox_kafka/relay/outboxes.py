"""Several outboxes for one relay process: the outboxes file and each outbox's settings.

The file is TOML, one table per outbox under ``outboxes``::

    [outboxes.orders]
    database_url_env = "ORDERS_DATABASE_URL"   # or database_url = "postgresql://..."

    [outboxes.tenant_a]
    database_url_env = "TENANTS_DATABASE_URL"
    schema = "tenant_a"                        # default: --db-schema
    table = "outbox"                           # default: --table
    batch_size = 200                           # default: --batch-size

An entry without a database URL uses ``--database-url``. An entry may also
set what its own relay loop does (``batch_size``, ``lease_seconds``,
``max_attempts``, ...: :data:`PER_OUTBOX`), each defaulting to its command-line
option; what belongs to the one Kafka producer or to the process
(``delivery_timeout_ms``, ``kafka_config``, ...: :data:`SHARED`) is refused,
saying why.
"""

from __future__ import annotations

import dataclasses
import os
import re
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from outbox_kafka.database import normalise_url
from outbox_kafka.errors import ConfigurationError
from outbox_kafka.naming import TableNames
from outbox_kafka.relay.settings import SECONDS_PER_DAY, RelaySettings

#: An outbox's name: a metrics label value and part of log lines, so short and plain.
_NAME = re.compile(r"[a-z][a-z0-9_-]{0,62}")
_CONNECTION_KEYS = frozenset({"database_url", "database_url_env", "schema", "table"})


@dataclass(frozen=True)
class Setting:
    """A relay setting an entry may give for its own outbox."""

    #: The :class:`RelaySettings` field it sets.
    field: str
    #: The TOML type it takes: ``int``, ``float`` (an integer too), ``bool`` or ``str``.
    kind: type
    #: The command-line option giving its default.
    option: str
    #: Turns the file's value into the field's (days into seconds, "" into None).
    convert: Callable[[Any], Any] = lambda value: value


#: The settings of each outbox's own loop: its claims, leases, retries and retention.
PER_OUTBOX: dict[str, Setting] = {
    "batch_size": Setting("batch_size", int, "--batch-size"),
    "max_claim_bytes": Setting("max_claim_bytes", int, "--max-claim-bytes"),
    "poll_interval": Setting("poll_interval", float, "--poll-interval"),
    "listen": Setting("listen", bool, "--no-listen"),
    "lease_seconds": Setting("lease_seconds", float, "--lease-seconds"),
    "backoff_base": Setting("backoff_base", float, "--backoff-base"),
    "backoff_cap": Setting("backoff_cap", float, "--backoff-cap"),
    "max_attempts": Setting("max_attempts", int, "--max-attempts"),
    "on_exhausted": Setting("on_exhausted", str, "--on-exhausted"),
    "dead_letter_topic": Setting(
        "dead_letter_topic", str, "--dead-letter-topic", lambda value: value or None
    ),
    "retain_delivered_days": Setting(
        "retain_delivered_seconds",
        float,
        "--retain-delivered-days",
        lambda days: days * SECONDS_PER_DAY,
    ),
    "retain_discarded_days": Setting(
        "retain_discarded_seconds",
        float,
        "--retain-discarded-days",
        lambda days: days * SECONDS_PER_DAY,
    ),
    "purge_interval": Setting("purge_interval", float, "--purge-interval"),
    "sample_interval": Setting("sample_interval", float, "--sample-interval"),
}

_PRODUCER = "it belongs to the one Kafka producer every outbox shares"
_PROCESS = "it belongs to the relay process, not to one outbox"
#: Relay settings an entry may not give, each with why and the option to use instead.
SHARED: dict[str, tuple[str, str]] = {
    "delivery_timeout_ms": (
        f"{_PRODUCER} (each outbox's lease_seconds must leave room for it)",
        "--delivery-timeout-ms",
    ),
    "kafka_config": (_PRODUCER, "--kafka-config"),
    "kafka_config_file": (_PRODUCER, "--kafka-config-file"),
    "bootstrap_servers": (_PRODUCER, "--bootstrap-servers"),
    "compression": (_PRODUCER, "--compression"),
    "create_topics": (
        f"{_PRODUCER}, which creates each missing topic once for all outboxes",
        "--create-topics",
    ),
    "shutdown_timeout": (_PROCESS, "--shutdown-timeout"),
    "drain_timeout": (_PROCESS, "--drain-timeout"),
    "metrics_port": (_PROCESS, "--metrics-port"),
    "metrics_host": (_PROCESS, "--metrics-host"),
    "log_level": (_PROCESS, "--log-level"),
    "log_format": (_PROCESS, "--log-format"),
}
_KEYS = _CONNECTION_KEYS | frozenset(PER_OUTBOX)


@dataclass(frozen=True)
class OutboxTarget:
    """One outbox a relay serves: a name, a database and a table."""

    name: str
    database_url: str = field(repr=False)  # may hold a password
    table: str
    db_schema: str
    #: Its own relay settings, by :class:`RelaySettings` field; the rest are the shared ones.
    settings: Mapping[str, Any] = field(default_factory=dict)

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
    for key in entry:
        if key in SHARED:
            why, option = SHARED[key]
            raise ConfigurationError(
                f"outbox {name!r}: {key} cannot be set per outbox: {why}; "
                f"set {option} for every outbox"
            )
    unknown = set(entry) - _KEYS
    if unknown:
        spelt = [k for k in sorted(unknown) if k.replace("-", "_") in _KEYS]
        hint = f" (keys are spelt with '_': {spelt[0].replace('-', '_')})" if spelt else ""
        raise ConfigurationError(
            f"outbox {name!r}: unknown key(s) {sorted(unknown)}{hint}; known: {sorted(_KEYS)}"
        )
    for key in _CONNECTION_KEYS & set(entry):
        value = entry[key]
        if not isinstance(value, str) or not value:
            raise ConfigurationError(f"outbox {name!r}: {key} must be a non-empty string")
    own = {
        PER_OUTBOX[key].field: _setting_value(name, key, value)
        for key, value in entry.items()
        if key in PER_OUTBOX
    }
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
        settings=own,
    )
    try:
        target.names  # noqa: B018 - validates the identifiers
    except ConfigurationError as exc:
        raise ConfigurationError(f"outbox {name!r}: {exc}") from None
    return target


_TYPE_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def _setting_value(name: str, key: str, value: Any) -> Any:
    """``value`` of the entry's ``key`` as its setting takes it, or refused naming both."""
    setting = PER_OUTBOX[key]
    kind = setting.kind
    # TOML has integers, floats and booleans apart; a boolean is no number here.
    fits = (
        isinstance(value, bool)
        if kind is bool
        else isinstance(value, (int, float)) and not isinstance(value, bool)
        if kind is float
        else isinstance(value, kind) and not isinstance(value, bool)
    )
    if not fits:
        raise ConfigurationError(
            f"outbox {name!r}: {key} must be {_TYPE_NAMES[kind]} (as {setting.option}), "
            f"not {value!r}"
        )
    return setting.convert(float(value) if kind is float else value)


def settings_for(shared: RelaySettings, target: OutboxTarget) -> RelaySettings:
    """The settings of the relay loop serving ``target``: ``shared`` with its database and
    table and the settings of its own entry, validated as the command-line options are.

    Its relay id gets the outbox's name, so the loops of one process tell apart in leases
    and logs. A setting of its own that the options would refuse (a range, the lease
    that must leave room for the shared delivery timeout) is refused naming the outbox.
    """
    try:
        return dataclasses.replace(
            shared,
            database_url=target.database_url,
            table=target.table,
            db_schema=target.db_schema,
            relay_id=f"{shared.relay_id}/{target.name}",
            **target.settings,
        )
    except ConfigurationError as exc:
        raise ConfigurationError(f"outbox {target.name!r}: {exc}") from None
