"""Several outboxes in one relay process: the outboxes file, each outbox's settings,
a relay loop per outbox sharing one producer, and their metrics served as one.

Each outbox gets a :class:`~outbox_kafka.relay.loop.Relay` of its own (its
own claim loop, connections, leases, retention and metrics) in a thread of
its own; they share one idempotent producer, each loop waiting for the
delivery reports of its own batches. A database that stops answering holds
up only its own outbox's loop, which retries it as a single relay does. An
unexpected error ends only its own outbox's loop: the outbox goes unready and
a new loop takes its place after a backoff.

The outboxes file is TOML, one table per outbox under ``outboxes``::

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

Each loop keeps its own :class:`~outbox_kafka.relay.metrics.RelayMetrics` on a
registry of its own; :func:`outbox_labelled_registry` serves them all as one set
of metric families, every sample labelled with the name of the outbox it counts.
The shared producer's gauges are served once, without the label.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import random
import re
import threading
import time
import tomllib
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from outbox_kafka.database import normalise_url
from outbox_kafka.errors import ConfigurationError
from outbox_kafka.naming import TableNames
from outbox_kafka.relay.batch import CycleReport, DrainResult
from outbox_kafka.relay.config import SECONDS_PER_DAY, RelaySettings
from outbox_kafka.relay.loop import Relay
from outbox_kafka.relay.metrics import ProducerMetrics, RelayMetrics
from outbox_kafka.relay.recover import PartitionReader
from outbox_kafka.relay.send import Publisher

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
    "on_unproven": Setting("on_unproven", str, "--on-unproven"),
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


#: The label that names the outbox of a sample.
OUTBOX_LABEL = "outbox"


class OutboxLabelledMetrics(Collector):
    """Collects several registries as one, adding ``outbox="<name>"`` to every sample.

    ``shared``: the metrics of what every outbox shares (the one producer),
    served as they are, without an ``outbox`` label: repeated under each
    outbox they would read as per-outbox values, and a sum over outboxes
    would count them once per outbox.
    """

    def __init__(
        self,
        registries: Mapping[str, CollectorRegistry],
        shared: CollectorRegistry | None = None,
    ) -> None:
        self._registries = dict(registries)
        self._shared = shared

    def collect(self) -> Iterable[Metric]:
        merged: dict[str, Metric] = {}
        if self._shared is not None:
            for family in self._shared.collect():
                merged[family.name] = family
        for outbox, registry in self._registries.items():
            for family in registry.collect():
                target = merged.get(family.name)
                if target is None:
                    target = merged[family.name] = Metric(
                        family.name, family.documentation, family.type, family.unit
                    )
                for sample in family.samples:
                    target.samples.append(
                        sample._replace(labels={OUTBOX_LABEL: outbox, **sample.labels})
                    )
        return merged.values()

    def describe(self) -> Iterable[Metric]:
        return []


def outbox_labelled_registry(
    registries: Mapping[str, CollectorRegistry], shared: CollectorRegistry | None = None
) -> CollectorRegistry:
    """A registry to serve: the outboxes' registries as one, labelled by outbox,
    and the ``shared`` registry's metrics once, unlabelled."""
    served = CollectorRegistry(auto_describe=False)
    served.register(OutboxLabelledMetrics(registries, shared))
    return served


log = logging.getLogger("outbox_kafka.relay")

#: The first wait before a failed loop is started again, seconds; it doubles
#: with each failure in a row, up to the cap.
RESTART_BACKOFF_BASE = 1.0
RESTART_BACKOFF_CAP = 30.0
#: A loop that ran this long before it failed starts its backoff afresh.
HEALTHY_RUN_SECONDS = 60.0


@dataclass
class _Failure:
    """An outbox's loop failed: why, how many times in a row, and the loop started in its place."""

    reason: str
    streak: int
    replaced_by: Relay | None = None


class RelayGroup:
    """The relay loops of several outboxes, started, stopped and drained together.

    ``relays`` maps each outbox's name to its loop; ``registries`` to the
    registry of its metrics (served together, labelled by outbox, by
    :func:`~outbox_kafka.relay.group.outbox_labelled_registry`);
    ``shared_registry`` holds the shared producer's gauges, served unlabelled.
    """

    def __init__(self, shared: RelaySettings, targets: list[OutboxTarget]) -> None:
        if not targets:
            raise ValueError("a relay group needs at least one outbox")
        self.settings = shared
        self._settings = {t.name: settings_for(shared, t) for t in targets}
        #: The one producer's gauges: one set, not one per outbox.
        self.producer_metrics = ProducerMetrics(CollectorRegistry())
        self.metrics = {
            t.name: RelayMetrics(CollectorRegistry(), producer=self.producer_metrics)
            for t in targets
        }
        self.publisher = Publisher.for_settings(
            _producer_settings(shared, list(self._settings.values())),
            self.producer_metrics.observe_librdkafka_stats,
        )
        self._stopping = threading.Event()
        #: Guards replacing a failed loop against :meth:`stop`.
        self._lock = threading.Lock()
        #: By outbox: the loop's last unexpected failure, until its replacement turns.
        self._failures: dict[str, _Failure] = {}
        #: By outbox: its last failure, until a loop of it runs well for a while
        #: (the backoff grows and the traceback is not logged again meanwhile).
        self._streaks: dict[str, _Failure] = {}
        self.relays: dict[str, Relay] = {}
        try:
            for target in targets:
                self.relays[target.name] = self._new_relay(target.name)
        except BaseException:
            self.close()
            raise

    @property
    def registries(self) -> Mapping[str, CollectorRegistry]:
        return {name: metrics.registry for name, metrics in self.metrics.items()}

    @property
    def shared_registry(self) -> CollectorRegistry:
        """The registry of what the outboxes share: the producer's gauges."""
        return self.producer_metrics.registry

    def last_cycle_at(self) -> float | None:
        """When the loop that has gone longest without a cycle last completed one.

        A loop waiting for its database to answer again counts as current:
        it is not stuck, and restarting the process would not bring that
        database back but would interrupt the other outboxes. So does a loop
        that failed and waits for its restart (readiness names it).
        """
        now = time.monotonic()
        oldest: float | None = now
        for name, relay in self.relays.items():
            if relay.waiting_on_database or self.loop_problem(name) is not None:
                continue
            at = relay.last_cycle_at
            if at is None:
                return None
            oldest = min(oldest, at) if oldest is not None else at
        return oldest

    def loop_problem(self, name: str) -> str | None:
        """Why the loop of outbox ``name`` is not running well, or None.

        A loop that failed is not ready until the loop started in its place
        has completed a cycle.
        """
        failure = self._failures.get(name)
        if failure is None:
            return None
        if failure.replaced_by is not None and failure.replaced_by.last_cycle_at is not None:
            self._failures.pop(name, None)
            return None
        return failure.reason

    def stop(self) -> None:
        """Stop every loop (each finishes and records its batch in flight); no loop restarts."""
        with self._lock:
            self._stopping.set()
            relays = list(self.relays.values())
        for relay in relays:
            relay.stop()

    def run(self) -> None:
        """Run every outbox's loop until :meth:`stop`.

        An unexpected error in one loop stays with its outbox: it is logged
        with its traceback, the outbox is not ready, and a new loop takes its
        place after a backoff; the other loops go on.
        """
        log.info(
            "relaying several outboxes",
            extra={
                "action": "outboxes",
                "outboxes": {
                    name: relay.settings.names.qualified_events
                    for name, relay in self.relays.items()
                },
            },
        )

        def run_one(name: str, relay: Relay) -> None:
            while True:
                started = time.monotonic()
                try:
                    relay.run()  # closes the loop, also when it raises
                    return
                except Exception as exc:
                    replacement = self._restart(name, exc, time.monotonic() - started)
                if replacement is None:
                    return
                relay = replacement

        self._each(run_one)
        self.publisher.close(timeout=min(5.0, self.settings.shutdown_timeout))

    def drain_all(self, timeout: float) -> dict[str, DrainResult]:
        """:meth:`Relay.drain_all` of every outbox, side by side; each outbox's result.

        A loop that fails is replaced, as in :meth:`run`, until ``timeout``;
        an outbox whose loop still fails then is reported incomplete, with
        what failed.
        """
        deadline = time.monotonic() + timeout
        results: dict[str, DrainResult] = {}

        def drain_one(name: str, relay: Relay) -> None:
            failed: str | None = None
            #: What the outbox's failed loops recorded during this drain, before they failed.
            before = CycleReport()
            while True:
                started = time.monotonic()
                recorded_before = relay.recorded
                try:
                    result = relay.drain_all(max(0.0, deadline - time.monotonic()))
                    if failed is not None:
                        report = dataclasses.replace(before)
                        report.add(result.report)
                        # Said even when the loop in its place drained everything.
                        error = result.error or f"the relay loop failed before ({failed})"
                        result = dataclasses.replace(result, report=report, error=error)
                    results[name] = result
                    return
                except Exception as exc:
                    with contextlib.suppress(Exception):
                        relay.close()  # its last batch is recorded, or left to its lease
                    before.add(relay.recorded.since(recorded_before))
                    failed = f"{type(exc).__name__}: {exc}"
                    replacement = self._restart(
                        name, exc, time.monotonic() - started, deadline=deadline
                    )
                if replacement is None:
                    results[name] = DrainResult(before, None, f"the relay loop failed ({failed})")
                    return
                relay = replacement

        self._each(drain_one)
        return {name: results[name] for name in self.relays}

    def _restart(
        self, name: str, exc: Exception, ran_for: float, *, deadline: float | None = None
    ) -> Relay | None:
        """After loop ``name`` failed with ``exc``: log it, wait the backoff, start a new loop.

        None when the group stops meanwhile, or ``deadline`` comes first. The
        failed loop's leased keys come back when their leases end, to the new
        loop or to another relay.
        """
        previous = self._streaks.get(name)
        if previous is not None and ran_for >= HEALTHY_RUN_SECONDS:
            previous = None  # it ran well for a while: a new streak
        streak = 0 if previous is None else previous.streak
        delay = min(RESTART_BACKOFF_CAP, RESTART_BACKOFF_BASE * 2**streak)
        delay *= random.uniform(0.8, 1.0)  # several relay processes do not restart in step
        reason = f"{type(exc).__name__}: {exc}"
        self._failures[name] = self._streaks[name] = _Failure(reason, streak + 1)
        self.metrics[name].loop_failures.inc()
        fields = {
            "action": "outbox_failed",
            "outbox": name,
            "error": reason,
            "failures": streak + 1,
            "restart_in": round(delay, 3),
        }
        if previous is not None and previous.reason == reason:
            # The same failure again: its traceback is in the log already.
            log.error("relay loop failed again; restarting it", extra=fields)
        else:
            log.error("relay loop failed; restarting it", exc_info=exc, extra=fields)
        while True:
            if deadline is not None and time.monotonic() + delay > deadline:
                return None
            if self._stopping.wait(delay):
                return None
            try:
                relay = self._new_relay(name)
            except Exception as again:
                reason = f"{type(again).__name__}: {again}"
                failure = _Failure(reason, self._streaks[name].streak + 1)
                self._failures[name] = self._streaks[name] = failure
                self.metrics[name].loop_failures.inc()
                log.error(
                    "relay loop could not be started again",
                    exc_info=again,
                    extra={**fields, "error": reason},
                )
                delay = min(RESTART_BACKOFF_CAP, delay * 2)
                continue
            with self._lock:
                if self._stopping.is_set():
                    relay.close()
                    return None
                self.relays[name] = relay
                self._failures[name].replaced_by = relay
            return relay

    def _new_relay(self, name: str) -> Relay:
        settings = self._settings[name]
        return Relay(
            settings,
            metrics=self.metrics[name],
            publisher=self.publisher,
            reader=PartitionReader(settings.admin_config()),
        )

    def _each(self, action: Callable[[str, Relay], None]) -> None:
        """``action(name, relay)`` for every outbox, each in a thread of its own; waits for all."""
        with ThreadPoolExecutor(
            max_workers=len(self.relays), thread_name_prefix="outbox-loop"
        ) as pool:
            futures = [pool.submit(action, name, relay) for name, relay in self.relays.items()]
        for future in futures:
            future.result()

    def close(self) -> None:
        """Close every loop (their connections), then the shared producer."""
        for relay in self.relays.values():
            relay.close()
        self.publisher.close(timeout=min(5.0, self.settings.shutdown_timeout))


def _producer_settings(shared: RelaySettings, loops: list[RelaySettings]) -> RelaySettings:
    """The settings the shared producer is made for: room in its queue for a batch of
    every loop at once, and metadata waits that fit the shortest lease."""
    return dataclasses.replace(
        shared,
        batch_size=sum(s.batch_size for s in loops),
        lease_seconds=min(s.lease_seconds for s in loops),
    )
