"""Liveness and readiness of a relay: is the loop turning, are PostgreSQL and Kafka reachable.

Liveness: the loop completed a cycle within the last ``max_cycle_age``
seconds (an idle relay completes one every poll interval; a cycle stuck on
an unreachable database does not complete). Readiness: ``SELECT 1`` answers
and a broker returns cluster metadata, each within ``timeout``; the result is
kept for ``cache_seconds`` so frequent probes cost one check.

A failed dependency check answers with a fixed phrase per check
(``"database": "unreachable"``), never the driver's or client's message:
those name hosts, ports, users and databases, and the endpoints answer
anyone who can reach the port. The full reason goes to the relay's log
instead: once when a check starts failing, once when it recovers, and while
it keeps failing only when the reason changes, at most once per
``log_interval`` seconds.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from outbox_kafka.errors import StorageError
from outbox_kafka.logs import redact
from outbox_kafka.relay.metrics import Monitor

if TYPE_CHECKING:
    from outbox_kafka.relay.config import RelaySettings
    from outbox_kafka.relay.group import RelayGroup
    from outbox_kafka.relay.loop import Relay

log = logging.getLogger("outbox_kafka.health")

OK = "ok"
#: What ``/readyz`` says about a failed check; the cause is in the relay's log.
DATABASE_FAILURE = "unreachable"
KAFKA_FAILURE = "no broker reachable"
#: What ``/readyz`` says about an outbox whose loop failed and waits for its restart.
LOOP_FAILURE = "failed, restarting"


@dataclass(frozen=True)
class HealthStatus:
    """The answer to one probe; ``details`` maps each part checked to ``"ok"`` or what failed.

    Everything here may be shown to an unauthenticated caller: dependency
    failures are fixed phrases, their causes are only logged.
    """

    ok: bool
    details: dict[str, object] = field(default_factory=dict)

    @property
    def reason(self) -> str:
        """Why it is not ok (empty when ok)."""
        return "; ".join(
            f"{name}: {value}"
            for name, value in self.details.items()
            if isinstance(value, str) and value != OK
        )

    def body(self) -> dict[str, object]:
        """The JSON answer: ``status``, ``reason`` when not ok, then ``details``."""
        body: dict[str, object] = {"status": "ok" if self.ok else "unavailable"}
        if not self.ok:
            body["reason"] = self.reason
        body.update(self.details)
        return body


def default_max_cycle_age(settings: RelaySettings) -> float:
    """How long without a completed cycle means the loop is stuck.

    A cycle sends for at most the delivery timeout (≤ 80% of the lease), and
    an idle relay completes one at least every poll interval.
    """
    return max(2.0 * settings.lease_seconds, 3.0 * settings.poll_interval, 10.0)


@dataclass
class _Failing:
    """A check that is failing: since when, and the reason last logged and when."""

    since: float
    reason: str
    logged_at: float


class FailureLog:
    """Logs why dependency checks fail without a line per probe.

    A check that starts failing is logged at once (warning, with the full
    reason); while it keeps failing, a different reason is logged at most
    once per ``interval`` seconds and the same reason never again; a recovery
    is logged once (info). Safe to call from several threads.
    """

    def __init__(self, interval: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval = interval
        self._clock = clock
        self._lock = threading.Lock()
        self._failing: dict[str, _Failing] = {}

    def record(self, check: str, problem: str | None) -> None:
        """Note the outcome of ``check``: None when it passed, else the full reason."""
        with self._lock:
            now = self._clock()
            failing = self._failing.get(check)
            if problem is None:
                if failing is not None:
                    del self._failing[check]
                    log.info(
                        "health check recovered",
                        extra={
                            "action": "health_check_recovered",
                            "check": check,
                            "failed_seconds": round(now - failing.since, 3),
                        },
                    )
                return
            problem = redact(problem)
            if failing is None:
                self._failing[check] = _Failing(since=now, reason=problem, logged_at=now)
                log.warning(
                    "health check failed",
                    extra={"action": "health_check_failed", "check": check, "error": problem},
                )
            elif problem != failing.reason and now - failing.logged_at >= self.interval:
                failing.reason, failing.logged_at = problem, now
                log.warning(
                    "health check still failing",
                    extra={
                        "action": "health_check_failed",
                        "check": check,
                        "error": problem,
                        "failed_seconds": round(now - failing.since, 3),
                    },
                )


def _pinging(monitor: Monitor) -> Callable[[float], str | None]:
    """A database check by ``monitor``: None when it answers, else why not."""

    def database_problem(timeout: float) -> str | None:
        try:
            monitor.ping(timeout)
        except StorageError as exc:
            return str(exc)
        return None

    return database_problem


def _loop_check(group: RelayGroup, name: str) -> Callable[[float], str | None]:
    """The check of outbox ``name``'s loop: None while it runs, else why it failed."""

    def loop_problem(timeout: float) -> str | None:
        return group.loop_problem(name)

    return loop_problem


class HealthChecks:
    """The checks behind ``/healthz`` and ``/readyz``; every dependency is injectable."""

    def __init__(
        self,
        *,
        last_cycle_at: Callable[[], float | None],
        max_cycle_age: float,
        database_problem: Callable[[float], str | None]
        | Mapping[str, Callable[[float], str | None]],
        kafka_problem: Callable[[float], str | None],
        loop_problem: Mapping[str, Callable[[float], str | None]] | None = None,
        timeout: float = 2.0,
        cache_seconds: float = 1.5,
        log_interval: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        on_close: Callable[[], None] | None = None,
    ) -> None:
        self._last_cycle_at = last_cycle_at
        self.max_cycle_age = max_cycle_age
        #: Each check's name, how it runs and what a failure says: ``database``, or
        #: ``database:<outbox>`` per outbox of a multi-outbox relay, and then its
        #: ``loop:<outbox>`` (the loop is not failed); then ``kafka``.
        databases = (
            [(f"database:{name}", check) for name, check in database_problem.items()]
            if isinstance(database_problem, Mapping)
            else [("database", database_problem)]
        )
        self._checks = [
            *((name, check, DATABASE_FAILURE) for name, check in databases),
            *(
                (f"loop:{name}", check, LOOP_FAILURE)
                for name, check in (loop_problem or {}).items()
            ),
            ("kafka", kafka_problem, KAFKA_FAILURE),
        ]
        self.timeout = timeout
        self.cache_seconds = cache_seconds
        self._clock = clock
        self._on_close = on_close
        self._lock = threading.Lock()
        self._cached: tuple[float, HealthStatus] | None = None
        self.failures = FailureLog(log_interval, clock)

    @classmethod
    def for_relay(cls, relay: Relay, *, max_cycle_age: float | None = None) -> HealthChecks:
        """Checks for ``relay``: its loop, a database connection of their own, its producer."""
        settings = relay.settings
        monitor = Monitor.connect(settings.database_url, settings.names)
        return cls(
            last_cycle_at=lambda: relay.last_cycle_at,
            max_cycle_age=default_max_cycle_age(settings)
            if max_cycle_age is None
            else max_cycle_age,
            database_problem=_pinging(monitor),
            kafka_problem=relay.publisher.broker_problem,
            on_close=monitor.close,
        )

    @classmethod
    def for_group(cls, group: RelayGroup) -> HealthChecks:
        """Checks for a multi-outbox relay: every loop, every outbox's database, the producer.

        Liveness fails when a loop is stuck (not when it waits for its
        database or for its restart: see :meth:`RelayGroup.last_cycle_at`);
        readiness names each outbox's database check, ``database:<outbox>``,
        and its loop, ``loop:<outbox>``: not ready from an unexpected error in
        the loop until the loop started in its place completes a cycle.
        """
        monitors: dict[str, Monitor] = {}

        def close() -> None:
            for monitor in monitors.values():
                monitor.close()

        try:
            for name, relay in group.relays.items():
                monitors[name] = Monitor.connect(relay.settings.database_url, relay.settings.names)
        except BaseException:
            close()
            raise

        return cls(
            last_cycle_at=group.last_cycle_at,
            # The slowest loop's: the outboxes may have leases and poll intervals of their own.
            max_cycle_age=max(default_max_cycle_age(r.settings) for r in group.relays.values()),
            database_problem={name: _pinging(m) for name, m in monitors.items()},
            kafka_problem=group.publisher.broker_problem,
            loop_problem={name: _loop_check(group, name) for name in group.relays},
            on_close=close,
        )

    def liveness(self) -> HealthStatus:
        """Ok when the loop completed a cycle within ``max_cycle_age`` seconds."""
        at = self._last_cycle_at()
        if at is None:
            return HealthStatus(False, {"loop": "no cycle completed yet"})
        age = max(0.0, self._clock() - at)
        details: dict[str, object] = {"last_cycle_seconds_ago": round(age, 3)}
        if age > self.max_cycle_age:
            details["loop"] = (
                f"no cycle completed for {age:.1f} s (limit {self.max_cycle_age:.0f} s)"
            )
            return HealthStatus(False, details)
        return HealthStatus(True, {"loop": OK, **details})

    def readiness(self) -> HealthStatus:
        """Ok when the database and a Kafka broker answer; cached for ``cache_seconds``."""
        with self._lock:
            now = self._clock()
            if self._cached is not None and now - self._cached[0] < self.cache_seconds:
                return self._cached[1]
            status = self._check_dependencies()
            self._cached = (self._clock(), status)
            return status

    def _check_dependencies(self) -> HealthStatus:
        """Run each dependency check; the answer names failed checks, the log says why."""
        details: dict[str, object] = {}
        for name, check, failure in self._checks:
            try:
                problem = check(self.timeout)
            except Exception as exc:  # a probe must answer, whatever the client raised
                problem = f"{type(exc).__name__}: {exc}"
            self.failures.record(name, problem)
            details[name] = OK if problem is None else failure
        return HealthStatus(all(v == OK for v in details.values()), details)

    def close(self) -> None:
        """Release what the checks hold (the database connection of their own)."""
        if self._on_close is not None:
            self._on_close()
