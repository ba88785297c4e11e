"""The three steps of a relay cycle, each timed and counted: claim a batch and check
its events, send it, record its outcome."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

from outbox_kafka.relay.batches import Claim
from outbox_kafka.relay.boundaries import ClaimStore, MessagePublisher
from outbox_kafka.relay.checks import EventChecks
from outbox_kafka.relay.metrics import RelayMetrics
from outbox_kafka.relay.policy import RetryPolicy
from outbox_kafka.relay.reports import CycleReport
from outbox_kafka.relay.retrying import DatabaseRetry
from outbox_kafka.relay.sending import BatchSender, SentBatch
from outbox_kafka.relay.settings import RelaySettings
from outbox_kafka.relay.sizing import ClaimSizer
from outbox_kafka.relay.tracing import SendTracing
from outbox_kafka.relay.verdicts import Problem

log = logging.getLogger("outbox_kafka.relay")


class Claimed(NamedTuple):
    """A claim, how many keys it asked for, and what its events' own checks found."""

    claim: Claim
    asked: int
    #: By ``id(event)``: the problem of the first event of a key that fails a check.
    problems: dict[int, Problem]
    #: ``time.monotonic()`` when the claim was asked for: its lease began after.
    asked_at: float


class CycleSteps:
    """Claim, send and record, against one store and one publisher."""

    def __init__(
        self,
        settings: RelaySettings,
        store: ClaimStore,
        publisher: MessagePublisher,
        metrics: RelayMetrics,
        policy: RetryPolicy,
        stopping: threading.Event,
        past_shutdown_deadline: Callable[[], bool],
        tracing: SendTracing | None = None,
    ) -> None:
        self.settings = settings
        self.store = store
        self.metrics = metrics
        self.db = DatabaseRetry(stopping, past_shutdown_deadline, metrics)
        self.delivery_timeout = settings.effective_delivery_timeout_ms / 1000
        self._checks = EventChecks(publisher.max_message_bytes)
        self._sizer = ClaimSizer(settings.batch_size)
        self._sender = BatchSender(
            publisher,
            policy,
            metrics,
            dead_letter_topic=settings.dead_letter_topic,
            delivery_timeout=self.delivery_timeout,
            abort=past_shutdown_deadline,
            tracing=tracing,
        )
        self.last_cycle_at: float | None = None

    def claim(self) -> Claimed:
        """Lease due keys, read their next events and check them.

        The checks need no broker, so a claim read ahead is checked while the
        batch before it waits for its acknowledgements.
        """
        started = time.monotonic()
        keys_wanted = self._sizer.keys_per_claim
        claim = self.db.run(
            lambda: self.store.claim(
                batch_size=self.settings.batch_size,
                lease_seconds=self.settings.lease_seconds,
                max_keys=keys_wanted,
                max_bytes=self.settings.max_claim_bytes,
            ),
            stop_on_shutdown=True,
        )
        self.metrics.claim_seconds.observe(time.monotonic() - started)
        return Claimed(claim, keys_wanted, self._checks.first_problems(claim), started)

    def send(self, claimed: Claimed) -> tuple[Claim, SentBatch]:
        """Send a claimed batch; its outcome is decided but not yet recorded."""
        claim = claimed.claim
        self._sizer.adapt(claim, claimed.asked)
        if not claim.keys:
            return claim, SentBatch()
        started = time.monotonic()
        lease_ends = claimed.asked_at + self.settings.lease_seconds
        sent = self._sender.send(claim, claimed.problems, lease_ends)
        self.metrics.publish_seconds.observe(time.monotonic() - started)
        return claim, sent

    def record(self, claim: Claim, sent: SentBatch) -> CycleReport:
        """Record a sent batch's outcome (one fenced statement) and count it."""
        report = CycleReport(keys=len(claim.keys), sent=sent.sent)
        if not claim.keys:
            self.last_cycle_at = time.monotonic()
            return report
        started = time.monotonic()
        result = self.db.run(
            lambda: self.store.record(claim.token, sent.keys, sent.events),
            stop_on_shutdown=False,
        )
        self.metrics.record_seconds.observe(time.monotonic() - started)
        report.keys_removed = result.keys_removed
        report.delivered = result.delivered
        report.retried = result.retried
        report.discarded = result.discarded
        report.leases_lost = len(sent.keys) - result.keys_owned
        if report.leases_lost:
            self.metrics.leases_lost.inc(report.leases_lost)
            log.warning(
                "lease lost: another relay took over keys while this batch was in flight",
                extra={"action": "lease_lost", "keys": report.leases_lost},
            )
        for latency in result.latencies:
            self.metrics.commit_to_ack_seconds.observe(latency)
        self.last_cycle_at = time.monotonic()
        return report
