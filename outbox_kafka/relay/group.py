"""Several outboxes in one relay process: a relay loop per outbox, one producer for all.

Each outbox gets a :class:`~outbox_kafka.relay.loop.Relay` of its own (its
own claim loop, connections, leases, retention and metrics) in a thread of
its own; they share one idempotent producer, each loop waiting for the
delivery reports of its own batches. A database that stops answering holds
up only its own outbox's loop, which retries it as a single relay does. An
unexpected error ends only its own outbox's loop: the outbox goes unready and
a new loop takes its place after a backoff.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import random
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from outbox_kafka.relay.loop import Relay
from outbox_kafka.relay.metrics import ProducerMetrics, RelayMetrics
from outbox_kafka.relay.outboxes import OutboxTarget, settings_for
from outbox_kafka.relay.publisher import Publisher
from outbox_kafka.relay.reports import CycleReport, DrainResult
from outbox_kafka.relay.settings import RelaySettings

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
    :func:`~outbox_kafka.relay.outbox_metrics.outbox_labelled_registry`);
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
            while True:
                started = time.monotonic()
                try:
                    result = relay.drain_all(max(0.0, deadline - time.monotonic()))
                    if failed is not None and result.error is None:
                        # Said even when the loop in its place drained everything.
                        result = dataclasses.replace(
                            result, error=f"the relay loop failed before ({failed})"
                        )
                    results[name] = result
                    return
                except Exception as exc:
                    with contextlib.suppress(Exception):
                        relay.close()
                    failed = f"{type(exc).__name__}: {exc}"
                    replacement = self._restart(
                        name, exc, time.monotonic() - started, deadline=deadline
                    )
                if replacement is None:
                    results[name] = DrainResult(
                        CycleReport(), None, f"the relay loop failed ({failed})"
                    )
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
        return Relay(self._settings[name], metrics=self.metrics[name], publisher=self.publisher)

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
