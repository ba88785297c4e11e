"""Several outboxes in one relay process: a relay loop per outbox, one producer for all.

Each outbox gets a :class:`~outbox_kafka.relay.loop.Relay` of its own (its
own claim loop, connections, leases, retention and metrics) in a thread of
its own; they share one idempotent producer, each loop waiting for the
delivery reports of its own batches. A database that stops answering holds
up only its own outbox's loop, which retries it as a single relay does.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor

from prometheus_client import CollectorRegistry

from outbox_kafka.relay.loop import Relay
from outbox_kafka.relay.metrics import ProducerMetrics, RelayMetrics
from outbox_kafka.relay.outboxes import OutboxTarget, settings_for
from outbox_kafka.relay.publisher import Publisher
from outbox_kafka.relay.reports import DrainResult
from outbox_kafka.relay.settings import RelaySettings

log = logging.getLogger("outbox_kafka.relay")


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
        #: The one producer's gauges: one set, not one per outbox.
        self.producer_metrics = ProducerMetrics(CollectorRegistry())
        self.metrics = {
            t.name: RelayMetrics(CollectorRegistry(), producer=self.producer_metrics)
            for t in targets
        }
        self.publisher = Publisher.for_settings(
            shared, self.producer_metrics.observe_librdkafka_stats
        )
        self.relays: dict[str, Relay] = {}
        try:
            for target in targets:
                self.relays[target.name] = Relay(
                    settings_for(shared, target),
                    metrics=self.metrics[target.name],
                    publisher=self.publisher,
                )
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
        database back but would interrupt the other outboxes.
        """
        now = time.monotonic()
        oldest: float | None = now
        for relay in self.relays.values():
            if relay.waiting_on_database:
                continue
            at = relay.last_cycle_at
            if at is None:
                return None
            oldest = min(oldest, at) if oldest is not None else at
        return oldest

    def stop(self) -> None:
        """Stop every loop (each finishes and records its batch in flight)."""
        for relay in self.relays.values():
            relay.stop()

    def run(self) -> None:
        """Run every outbox's loop until :meth:`stop`; an unexpected error in one stops all."""
        failures: list[BaseException] = []
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
            try:
                relay.run()
            except BaseException as exc:
                log.error(
                    "relay loop failed; stopping every outbox",
                    extra={"action": "outbox_failed", "outbox": name, "error": repr(exc)},
                )
                failures.append(exc)
                self.stop()

        self._each(run_one)
        self.publisher.close(timeout=min(5.0, self.settings.shutdown_timeout))
        if failures:
            raise failures[0]

    def drain_all(self, timeout: float) -> dict[str, DrainResult]:
        """:meth:`Relay.drain_all` of every outbox, side by side; each outbox's result."""
        results: dict[str, DrainResult] = {}

        def drain_one(name: str, relay: Relay) -> None:
            results[name] = relay.drain_all(timeout)

        self._each(drain_one)
        return {name: results[name] for name in self.relays}

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
