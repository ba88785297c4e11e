"""The relay loop: claim a batch, publish it, record the outcome, repeat.

One cycle is: claim (one short transaction) -> check and produce every
claimed event -> wait once for all delivery reports -> record the outcome
(one fenced statement). No transaction is open while messages are in flight.
This module is the relay's engine; the producer-facing API never imports it.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import NamedTuple, TypeVar

from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_exception_type,
    wait_exponential_jitter,
)

from outbox_kafka.errors import EventError, StorageError
from outbox_kafka.limits import enqueue_limit_for
from outbox_kafka.producer.envelope import check_topic, message_size
from outbox_kafka.relay.metrics import RelayMetrics
from outbox_kafka.relay.publisher import (
    DELIVERED,
    PERMANENT,
    RETRIABLE,
    Delivery,
    Message,
    Publisher,
    check_envelope,
)
from outbox_kafka.relay.sampler import BacklogSampler
from outbox_kafka.relay.settings import RelaySettings, redact_kafka_config
from outbox_kafka.relay.store import (
    Claim,
    ClaimedEvent,
    ClaimedKey,
    EventOutcome,
    KeyOutcome,
    Remaining,
    Store,
)

log = logging.getLogger("outbox_kafka.relay")

T = TypeVar("T")

#: How long a relay about to wait idle waits for producers' transactions that
#: hold the wake lock (they sent no notify) before it waits anyway, briefly.
_IDLE_LOCK_WAIT = 0.1
#: An idle relay checks for stop() (and, without the wake lock, tries to take
#: it) at least this often (seconds).
_STOP_CHECK = 0.25


@dataclass
class CycleReport:
    """What one cycle did; ``drain()`` sums these."""

    keys: int = 0
    keys_removed: int = 0
    sent: int = 0
    delivered: int = 0
    retried: int = 0
    discarded: int = 0
    leases_lost: int = 0

    @property
    def progressed(self) -> bool:
        """Whether the cycle changed anything: sent or set aside events, or cleared empty keys.

        A claim can come back with only keys whose events are all done (they
        leave the queue in that cycle) while keys with work wait behind them;
        the next cycle should then follow at once.
        """
        return self.sent > 0 or self.keys_removed > 0 or self.discarded > 0


@dataclass(frozen=True)
class DrainResult:
    """What :meth:`Relay.drain_all` did, and what it left pending and why."""

    report: CycleReport
    #: What is left; None when it could not be read (``error`` says why).
    left: Remaining | None
    error: str | None = None

    @property
    def complete(self) -> bool:
        """Nothing is left pending."""
        return self.left is not None and self.left.pending == 0

    def summary(self) -> str:
        """One line for people: what was sent, and what is left and why."""
        r, left = self.report, self.left
        line = (
            f"drained: {r.delivered} delivered, {r.discarded} discarded, "
            f"{r.retried} retried, {r.leases_lost} leases lost"
        )
        if left is None:
            return f"{line}; could not read what is left pending: {self.error}"
        if self.complete:
            return line + "; nothing left pending"
        reasons = [
            (left.leased, "on keys another relay still holds a lease on"),
            (left.parked, "on parked keys (outbox-kafka requeue or unpark)"),
            (left.retrying, "waiting for a retry"),
            (left.delayed, "delayed (available_at)"),
            (left.due, "due now (written during the drain)"),
            (left.unreachable, "unreachable by the key queue (outbox-kafka check --consistency)"),
        ]
        why = ", ".join(f"{n} {what}" for n, what in reasons if n)
        when = (
            ""
            if left.next_due_seconds is None
            else f"; the next key comes due in {max(0.0, left.next_due_seconds):.1f} s"
        )
        return f"{line}; left pending: {left.pending} ({why}){when}"


class _Claimed(NamedTuple):
    """A claim, how many keys it asked for, and what its events' own checks found."""

    claim: Claim
    asked: int
    #: By ``id(event)``: (verdict, reason) of the first event of a key that fails a check.
    problems: dict[int, tuple[str, str]]
    #: ``time.monotonic()`` when the claim was asked for: its lease began after.
    asked_at: float


@dataclass
class _Batch:
    """A claimed batch after sending: what to record for it."""

    claim: Claim
    report: CycleReport
    key_outcomes: list[KeyOutcome] = field(default_factory=list)
    event_outcomes: list[EventOutcome] = field(default_factory=list)


def _worth_reading_ahead(claim: Claim, asked: int, batch_size: int) -> bool:
    """Whether to read the next claim while this one is sent.

    Only when the relay is behind: the claim filled half the batch or ran
    out of keys to ask for. A claim read ahead is taken before the events
    committed during the send, so when the relay keeps up, reading ahead
    would make every event wait one cycle more.
    """
    if not any(k.events and k.events[0].due for k in claim.keys):
        return False
    return claim.event_count * 2 >= batch_size or len(claim.keys) >= asked


#: Verdicts of events that did not reach the producer, or are still inside it.
_UNSENT = "unsent"
_UNREPORTED = "unreported"
#: A dead-letter copy that did not go out in this batch: the event is retried later.
_COPY_NOT_SENT = (RETRIABLE, "the dead-letter copy was not sent in this batch")


def _verdict_of(
    event: ClaimedEvent, precheck: dict[int, tuple[str, str]], deliveries: dict[int, Delivery]
) -> tuple[str, str | None]:
    """What became of a claimed event in this batch: (verdict, error)."""
    problem = precheck.get(id(event))
    if problem is not None:
        return problem
    delivery = deliveries.get(id(event))
    if delivery is None or not delivery.sent:
        return _UNSENT, None
    if not delivery.reported:
        return _UNREPORTED, delivery.error
    return delivery.verdict, delivery.error


def _discard_reason(event: ClaimedEvent, verdict: str, error: str | None) -> str:
    """Why an event is discarded: its error, or the attempts it was given."""
    if verdict == PERMANENT:
        return error or "unknown error"
    return f"gave up after {event.attempts + 1} attempts: {error}"


def _sendable(ck: ClaimedKey) -> list[ClaimedEvent]:
    """The key's claimed events that may go out in this batch: the due ones, in order,
    up to the first for another topic than the first's.

    Kafka orders messages within a partition only, so an event for another topic
    could land while an earlier one of its key is still unacknowledged and then
    fails. It goes in a later batch, once everything before it is recorded.
    """
    run: list[ClaimedEvent] = []
    for event in ck.events:
        if not event.due or event.topic != ck.events[0].topic:
            break
        run.append(event)
    return run


def backoff_delay(attempt: int, base: float, cap: float, rng: random.Random) -> float:
    """Exponential backoff with jitter: uniform in [d/2, d], d = min(cap, base * 2**(attempt-1))."""
    ceiling: float = min(cap, base * 2.0 ** max(0, min(attempt - 1, 62)))
    return ceiling / 2 + rng.random() * ceiling / 2


class Relay:
    """Publishes committed outbox events to Kafka.

    ``run()`` loops until :meth:`stop`; ``drain()`` publishes everything due
    and returns. Both are synchronous; call :meth:`stop` from a signal
    handler or another thread.
    """

    def __init__(
        self,
        settings: RelaySettings,
        *,
        metrics: RelayMetrics | None = None,
        store: Store | None = None,
        publisher: Publisher | None = None,
    ) -> None:
        self.settings = settings
        self.metrics = metrics or RelayMetrics()
        self.metrics.set_info(settings)
        self.store = store or Store(settings.database_url, settings.names)
        self.publisher = publisher or Publisher(
            settings.producer_config(),
            settings.admin_config(),
            create_partitions=settings.create_topics,
            stats_callback=self.metrics.observe_librdkafka_stats,
            metadata_timeout=min(5.0, settings.lease_seconds / 4),
        )
        self._stop = threading.Event()
        self._stop_deadline: float | None = None
        self._rng = random.Random()
        self._last_purge = 0.0
        self._valid_topics: set[str] = set()
        self._keys_per_claim = settings.batch_size
        self.last_cycle_at: float | None = None
        self.metrics.watch_last_cycle(lambda: self.last_cycle_at)
        self._delivery_timeout = settings.effective_delivery_timeout_ms / 1000
        self._send_timeout = self._delivery_timeout + 5.0
        # One batch's outcome is recorded here while the next batch is claimed
        # and sent: the database and Kafka work overlap, and a key is never in
        # two batches at once because its lease holds until its record is done.
        self._recorder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="outbox-record")
        self._recording: Future[CycleReport] | None = None
        # Likewise the next claim is read while a batch is being sent. Its keys
        # are leased like any claim's; a claim that is never sent is released.
        self._claimer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="outbox-claim")
        self._claiming: Future[_Claimed] | None = None

    # Control -----------------------------------------------------------------

    def stop(self) -> None:
        """Stop claiming; the batch in flight is flushed and recorded, then run() returns."""
        if not self._stop.is_set():
            self._stop_deadline = time.monotonic() + self.settings.shutdown_timeout
            self._stop.set()

    def _past_shutdown_deadline(self) -> bool:
        return self._stop_deadline is not None and time.monotonic() > self._stop_deadline

    def run(self) -> None:
        """Relay until :meth:`stop` is called."""
        log.info(
            "relay started",
            extra={
                "action": "start",
                "relay_id": self.settings.relay_id,
                "database": self.store.url_for_logs,
                "table": self.settings.names.qualified_events,
                "kafka": redact_kafka_config(self.settings.producer_config()),
            },
        )
        purger = threading.Thread(target=self._purge_loop, name="outbox-purge", daemon=True)
        purger.start()
        sampler = BacklogSampler(self.settings, self.metrics).start()
        try:
            while not self._stop.is_set():
                _, progressed = self._guarded_cycle()
                if progressed:
                    self._stay_busy()
                else:
                    self._idle_wait()
        finally:
            # Also after an error: the shutdown deadline bounds the last records.
            self.stop()
            purger.join(timeout=5)
            sampler.stop()
            self.close()
            log.info("relay stopped", extra={"action": "stop", "relay_id": self.settings.relay_id})

    def drain(self) -> CycleReport:
        """Publish everything due now, then return what was done (the relay stays open)."""
        total = CycleReport()
        while not self._stop.is_set():
            report, progressed = self._guarded_cycle()
            _add(total, report)
            if not progressed:
                # Nothing was claimed, or only keys with nothing due: all due work is done.
                break
        self._release_prefetched()
        _add(total, self._await_recording())
        return total

    def drain_all(self, timeout: float) -> DrainResult:
        """Publish until nothing is left that this relay could send within ``timeout`` seconds.

        Unlike :meth:`drain`, waits for what comes due before the deadline:
        keys leased by another relay (a relay that died holds its keys until
        its leases end), retries after their backoff, delayed events. Parked
        keys and unreachable events are left as they are and reported, as is
        whatever comes due only after the deadline. The deadline bounds the
        waiting, not the sending: while writers keep adding due work, this
        goes on. :meth:`stop` ends it; so does a database that stays down
        past the deadline (what is left is then unknown).
        """
        deadline = time.monotonic() + timeout
        total = CycleReport()
        while True:
            _add(total, self.drain())
            try:
                left = self._with_db_retry(
                    self.store.remaining,
                    stop_on_shutdown=True,
                    give_up=lambda: time.monotonic() > deadline,
                )
            except StorageError as exc:
                return DrainResult(total, None, str(exc))
            if left.pending == 0 or self._stop.is_set() or left.next_due_seconds is None:
                return DrainResult(total, left)
            wait = max(0.05, left.next_due_seconds)
            if time.monotonic() + wait > deadline:
                return DrainResult(total, left)
            self._stop.wait(wait)

    def close(self) -> None:
        self._release_prefetched()
        self._await_recording()
        self._claimer.shutdown(wait=True)
        self._recorder.shutdown(wait=True)
        self.publisher.close(timeout=min(5.0, self.settings.shutdown_timeout))
        self.store.close()

    # The cycle ---------------------------------------------------------------

    def _guarded_cycle(self) -> tuple[CycleReport, bool]:
        """One pipelined cycle: (what finished recording meanwhile, whether anything moved).

        While this cycle's batch is sent, the next claim is read on its own
        connection; the previous batch is recorded on a third while this
        cycle's claim is finished and checked. The record always commits
        before this batch is produced, so at any moment at most one batch is
        with Kafka and not yet recorded: all that a killed relay can leave to
        be sent twice. A key is never in two batches at once: its lease holds
        from its claim until its record.
        """
        done = CycleReport()
        try:
            claimed = self._next_claim()
        except StorageError as exc:
            # The claim already retried; only a stop request gets us here.
            log.warning("database unavailable", extra={"action": "db_error", "error": str(exc)})
            _add(done, self._await_recording())
            return done, False
        claim, asked = claimed.claim, claimed.asked
        if not self._stop.is_set() and _worth_reading_ahead(claim, asked, self.settings.batch_size):
            self._claiming = self._claimer.submit(self._claim)
        previous = self._await_recording()
        _add(done, previous)
        batch = self._publish_claim(claimed)
        if batch.report.sent:
            self._recording = self._recorder.submit(self._record, batch)
            return done, True
        report = self._record(batch)
        _add(done, report)
        # Keys just released by the previous record may have more work, and keys
        # producers added may not all have joined the queue yet: go again.
        return done, report.progressed or previous.progressed or self.store.arrivals_left

    def _next_claim(self) -> _Claimed:
        """The claim read ahead during the last cycle, or a new one."""
        claiming, self._claiming = self._claiming, None
        if claiming is not None:
            claimed = claiming.result()
            lease_left = self.settings.lease_seconds - (time.monotonic() - claimed.asked_at)
            if lease_left >= self._delivery_timeout:
                return claimed
            # It waited behind a slow send: what is left of its lease would not
            # cover a send of its own, so its keys could pass to another relay
            # while their messages are still in flight. Claim them afresh.
            log.info(
                "claim read ahead outlived its use; released",
                extra={"action": "release", "keys": len(claimed.claim.keys)},
            )
            self._release(claimed.claim)
        return self._claim()

    def _release_prefetched(self) -> None:
        """Give back the keys of a claim read ahead that will not be sent."""
        claiming, self._claiming = self._claiming, None
        if claiming is None:
            return
        try:
            claim = claiming.result().claim
        except StorageError:
            return  # nothing was leased
        self._release(claim)

    def _release(self, claim: Claim) -> None:
        """Hand a claim's keys back as they were, to be claimed again at once."""
        release = [KeyOutcome(k.key, k.next_seq, 0.0, False, False) for k in claim.keys]
        self._record(_Batch(claim, CycleReport(keys=len(claim.keys)), release))

    def _await_recording(self) -> CycleReport:
        """Wait for the outstanding background record, if any, and return its report."""
        recording, self._recording = self._recording, None
        if recording is None:
            return CycleReport()
        try:
            return recording.result()
        except StorageError as exc:
            # Recording retries until the shutdown deadline; past it, the keys
            # stay leased and another relay sends their events again later.
            log.warning(
                "could not record a batch before shutdown; its keys wait for their lease",
                extra={"action": "db_error", "error": str(exc)},
            )
            return CycleReport()

    def cycle(self) -> CycleReport:
        """One claim -> publish -> record round, recorded before it returns."""
        report = self._await_recording()
        _add(report, self._record(self._publish_claim(self._next_claim())))
        return report

    def _claim(self) -> _Claimed:
        """Lease due keys, read their next events and check them.

        The checks need no broker, so a claim read ahead is checked while the
        batch before it waits for its acknowledgements.
        """
        started = time.monotonic()
        keys_wanted = self._keys_per_claim
        claim = self._with_db_retry(
            lambda: self.store.claim(
                batch_size=self.settings.batch_size,
                lease_seconds=self.settings.lease_seconds,
                max_keys=keys_wanted,
                max_bytes=self.settings.max_claim_bytes,
            ),
            stop_on_shutdown=True,
        )
        self.metrics.claim_seconds.observe(time.monotonic() - started)
        return _Claimed(claim, keys_wanted, self._check_claim(claim), started)

    def _check_claim(self, claim: Claim) -> dict[int, tuple[str, str]]:
        """The first due event of each key that fails its own checks, with (verdict, reason)."""
        problems: dict[int, tuple[str, str]] = {}
        for ck in claim.keys:
            key = ck.key.encode()
            for event in _sendable(ck):
                problem = self._check_event(event, key)
                if problem is not None:
                    problems[id(event)] = problem
                    break
        return problems

    def _publish_claim(self, claimed: _Claimed) -> _Batch:
        """Send a claimed batch; its outcome is decided but not yet recorded."""
        claim = claimed.claim
        self._adapt_keys_per_claim(claim, claimed.asked)
        batch = _Batch(claim, CycleReport(keys=len(claim.keys)))
        if claim.keys:
            publish_started = time.monotonic()
            batch.key_outcomes, batch.event_outcomes, batch.report.sent = self._publish(
                claim, claimed.problems, claimed.asked_at + self.settings.lease_seconds
            )
            self.metrics.publish_seconds.observe(time.monotonic() - publish_started)
        return batch

    def _record(self, batch: _Batch) -> CycleReport:
        """Record a sent batch's outcome (one fenced statement) and count it."""
        report = batch.report
        if not batch.claim.keys:
            self.last_cycle_at = time.monotonic()
            return report
        key_outcomes = batch.key_outcomes
        mark_started = time.monotonic()
        result = self._with_db_retry(
            lambda: self.store.finish(batch.claim.token, key_outcomes, batch.event_outcomes),
            stop_on_shutdown=False,
        )
        self.metrics.mark_seconds.observe(time.monotonic() - mark_started)
        report.keys_removed = result.keys_removed
        report.delivered = result.delivered
        report.retried = result.retried
        report.discarded = result.discarded
        report.leases_lost = len(key_outcomes) - result.keys_owned
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

    def _adapt_keys_per_claim(self, claim: Claim, asked: int) -> None:
        """Claim fewer keys when keys have several events waiting, more when they have few.

        Most of a cycle's database work is per key (lease, release), so a
        backlog of a few events on each of many keys is best served a few
        events per key, not one; a hot key already gets the whole batch.
        """
        batch = self.settings.batch_size
        if not claim.keys or any(k.withheld for k in claim.keys):
            # The byte budget, not the number of keys, bounded this claim.
            return
        # What each key can send now: a key whose events switch topics sends
        # only its first run, however many events it brought.
        runs = [len(_sendable(k)) for k in claim.keys]
        # Keys that can send their whole share of the batch and had more waiting.
        full = sum(
            1
            for k, run in zip(claim.keys, runs, strict=True)
            if run >= claim.per_key_limit and (k.last_seq is None or k.waiting > len(k.events))
        )
        floor = max(1, batch // 64)
        if full * 2 > len(claim.keys) > floor:
            # Also when fewer keys were due than asked for: what counts is that
            # most keys had more waiting than their share of the batch. Enough
            # keys for a full batch at the typical key's backlog, at most half.
            waiting = sorted(k.waiting for k in claim.keys)[len(claim.keys) // 2]
            self._keys_per_claim = max(floor, min(len(claim.keys) // 2, batch // waiting))
        elif sum(runs) * 4 < batch * 3 and len(claim.keys) >= asked and asked < batch:
            self._keys_per_claim = min(batch, asked * 2)

    def _publish(
        self, claim: Claim, problems: dict[int, tuple[str, str]], lease_ends: float
    ) -> tuple[list[KeyOutcome], list[EventOutcome], int]:
        """Send the claimed events; decide every key's and event's next state.

        Everything sent under the claim's lease is started only while a whole
        delivery timeout of the lease is left, so it is delivered or timed out
        before another relay can take the keys: the events, with the
        dead-letter copies of events already known to be discarded, in one
        send; then, in a second send, the copies of events the broker's
        answers discarded.
        """
        key_outcomes: list[KeyOutcome] = []
        plans: list[tuple[ClaimedKey, list[ClaimedEvent]]] = []
        to_send: list[Message] = []
        sendable: list[ClaimedEvent] = []
        precheck: dict[int, tuple[str, str]] = {}
        discarded_first: list[tuple[ClaimedEvent, str]] = []

        for ck in claim.keys:
            due = _sendable(ck)
            if not due:
                # Nothing to send now: the key is empty, its next event is not due
                # yet, or its events were left out of the claim for its byte budget.
                if ck.withheld and not ck.events:
                    key_outcomes.append(KeyOutcome(ck.key, ck.next_seq, 0.0, False, False))
                elif ck.events:
                    wait = max(0.0, ck.events[0].wait_seconds)
                    key_outcomes.append(KeyOutcome(ck.key, ck.next_seq, wait, False, False))
                else:
                    # Every event up to last_seq is done (none pending in the same
                    # snapshot), so the key may leave the queue unless a writer has
                    # added one since; the outcome statement checks that under lock.
                    done = max(ck.next_seq, (ck.last_seq or 0) + 1)
                    key_outcomes.append(KeyOutcome(ck.key, done, 0.0, False, True))
                continue
            plans.append((ck, due))
            key = ck.key.encode()
            for event in due:
                problem = problems.get(id(event)) or self.publisher.topic_problem(event.topic)
                if problem is not None:
                    # Nothing later of this key goes out in this batch: whatever
                    # becomes of this event (retry, park, discard), it is settled
                    # before anything behind it is sent.
                    precheck[id(event)] = problem
                    if event is due[0] and self._gives_up(event, problem[0]):
                        # Nothing of its key comes before it in this batch: it is
                        # discarded whatever the send brings, so its copy goes
                        # with the send. Behind earlier events of its key, it is
                        # discarded only if they all reach Kafka: decided after.
                        discarded_first.append((event, _discard_reason(event, *problem)))
                    break
                sendable.append(event)
                to_send.append(Message(event.topic, key, event.value, event.headers or []))

        copies: dict[int, tuple[str, str | None]] = {}
        first_copies = self._dead_letter_messages(discarded_first, copies)
        deliveries_by_event: dict[int, Delivery] = {}
        if to_send or first_copies:
            deliveries = self._send_within_lease(to_send + first_copies, lease_ends)
            sent = deliveries[: len(to_send)]
            deliveries_by_event = {id(e): d for e, d in zip(sendable, sent, strict=True)}
            self._note_copies(discarded_first, deliveries[len(to_send) :], copies)

        discarded_later = [
            (event, reason)
            for ck, due in plans
            for event, reason in self._discards(due, precheck, deliveries_by_event)
            if id(event) not in copies
        ]
        later_copies = self._dead_letter_messages(discarded_later, copies)
        if later_copies:
            self._note_copies(
                discarded_later, self._send_within_lease(later_copies, lease_ends), copies
            )

        event_outcomes: list[EventOutcome] = []
        published: dict[str, int] = {}
        for ck, due in plans:
            outcome = self._settle_key(
                ck,
                due,
                precheck,
                deliveries_by_event,
                copies,
                event_outcomes,
                claim.per_key_limit,
                published,
            )
            key_outcomes.append(outcome)
        for topic, count in published.items():
            self.metrics.published.labels(topic=topic).inc(count)
        return key_outcomes, event_outcomes, len(to_send)

    def _send_within_lease(self, messages: list[Message], lease_ends: float) -> list[Delivery]:
        """Send ``messages`` if the lease outlasts their delivery timeout; else none (unsent).

        Metadata lookups and topic creation before the send count against the
        lease: they have run by now.
        """
        left = lease_ends - time.monotonic()
        if left < self._delivery_timeout:
            log.warning(
                "too little of the lease left to send; the keys go back to the queue",
                extra={
                    "action": "send_skipped",
                    "messages": len(messages),
                    "lease_left_seconds": round(max(0.0, left), 3),
                },
            )
            return [Delivery() for _ in messages]
        return self.publisher.send(
            messages, timeout=self._send_timeout, abort=self._past_shutdown_deadline
        )

    def _gives_up(self, event: ClaimedEvent, verdict: str) -> bool:
        """Whether an event that failed with ``verdict`` this time is discarded (or parked)."""
        return verdict == PERMANENT or event.attempts + 1 >= self.settings.max_attempts

    def _discards(
        self,
        due: list[ClaimedEvent],
        precheck: dict[int, tuple[str, str]],
        deliveries: dict[int, Delivery],
    ) -> list[tuple[ClaimedEvent, str]]:
        """The events of one key that :meth:`_settle_key` discards, with their reasons,
        if every dead-letter copy succeeds (a failed copy holds the key at its event,
        so a later one may have been copied in vain: copies are at least once)."""
        found: list[tuple[ClaimedEvent, str]] = []
        for event in due:
            verdict, error = _verdict_of(event, precheck, deliveries)
            if verdict == DELIVERED:
                continue
            if verdict in (_UNSENT, _UNREPORTED) or not self._gives_up(event, verdict):
                break
            found.append((event, _discard_reason(event, verdict, error)))
            if self.settings.on_exhausted == "park":
                break
        return found

    def _dead_letter_messages(
        self, discarded: list[tuple[ClaimedEvent, str]], copies: dict[int, tuple[str, str | None]]
    ) -> list[Message]:
        """The dead-letter copies of ``discarded`` to send; where none can be sent (no
        dead-letter topic, or a topic problem), the copy's verdict goes in ``copies``."""
        topic = self.settings.dead_letter_topic
        if not discarded:
            return []
        if topic is None:
            copies.update((id(event), (DELIVERED, None)) for event, _ in discarded)
            return []
        problem = self.publisher.topic_problem(topic)
        if problem is not None:
            copies.update((id(event), problem) for event, _ in discarded)
            return []
        return [
            Message(
                topic,
                event.key.encode(),
                event.value,
                [
                    *(event.headers or []),
                    ("outbox_error", reason.encode("utf-8", "replace")[:4096]),
                    ("outbox_original_topic", event.topic.encode()),
                ],
            )
            for event, reason in discarded
        ]

    @staticmethod
    def _note_copies(
        discarded: list[tuple[ClaimedEvent, str]],
        deliveries: list[Delivery],
        copies: dict[int, tuple[str, str | None]],
    ) -> None:
        """Record how the dead-letter copies of ``discarded`` fared, where they were sent
        (``deliveries`` is empty where :meth:`_dead_letter_messages` made none)."""
        for (event, _), delivery in zip(discarded, deliveries, strict=False):
            if not delivery.sent:
                copies[id(event)] = _COPY_NOT_SENT
            elif not delivery.reported:
                copies[id(event)] = (RETRIABLE, "no delivery report for the dead-letter copy")
            else:
                copies[id(event)] = (delivery.verdict, delivery.error)

    def _check_event(self, event: ClaimedEvent, key: bytes) -> tuple[str, str] | None:
        """What is wrong with the event itself, if anything: (verdict, reason)."""
        if event.topic not in self._valid_topics:
            try:
                check_topic(event.topic)
            except EventError as exc:
                return PERMANENT, f"INVALID_TOPIC: {exc.reason}"
            self._valid_topics.add(event.topic)
        text = event.text
        problem = check_envelope(event.value if text is None else text, event.event_id, event.key)
        if problem is not None:
            return PERMANENT, f"INVALID_ENVELOPE: {problem}"
        if event.headers is None:
            return PERMANENT, "INVALID_HEADERS: the stored headers are not [[name, value], ...]"
        size = message_size(key, event.value, event.headers)
        if size > self.publisher.max_message_bytes:
            return (
                PERMANENT,
                f"MSG_SIZE_TOO_LARGE: message is {size} bytes, over the relay's "
                f"message.max.bytes ({self.publisher.max_message_bytes}; producers of this "
                "relay should pass max_message_bytes="
                f"{enqueue_limit_for(self.publisher.max_message_bytes)} to Outbox)",
            )
        return None

    def _settle_key(
        self,
        ck: ClaimedKey,
        due: list[ClaimedEvent],
        precheck: dict[int, tuple[str, str]],
        deliveries: dict[int, Delivery],
        copies: dict[int, tuple[str, str | None]],
        out: list[EventOutcome],
        per_key_limit: int,
        published: dict[str, int],
    ) -> KeyOutcome:
        """Walk one key's events in sequence order and decide what happens next.

        Delivered events are recorded as delivered whatever happened before
        them (that is the truth in Kafka). The first event that failed
        retriably holds the key: it is retried after a backoff and nothing
        after it is sent until it succeeds or is discarded.
        """
        settings = self.settings
        park = settings.on_exhausted == "park"
        next_seq = due[-1].seq + 1
        delay = 0.0
        parked = False
        blocked = False
        #: An earlier event of the key in this batch that did not reach Kafka and
        #: still should before anything after it (retry, unsent, parked).
        held_back: ClaimedEvent | None = None
        for event in due:
            verdict, error = _verdict_of(event, precheck, deliveries)
            if verdict == DELIVERED:
                delivery = deliveries[id(event)]
                if held_back is not None:
                    self._order_violated(held_back, event)
                out.append(
                    EventOutcome(
                        event.event_id,
                        ck.key,
                        "delivered",
                        0,
                        0.0,
                        delivery.partition,
                        delivery.offset,
                        None,
                    )
                )
                published[event.topic] = published.get(event.topic, 0) + 1
                continue
            if blocked:
                continue
            if verdict in (_UNSENT, _UNREPORTED):
                # Not handed over, or still inside the producer: leave it pending and
                # keep the key off limits for a lease period so no copy overtakes it.
                held_back = held_back or event
                blocked = True
                next_seq = event.seq
                delay = settings.lease_seconds if verdict == _UNREPORTED else 0.0
                continue
            attempt = event.attempts + 1
            if not self._gives_up(event, verdict):
                self.metrics.retried.labels(topic=event.topic, reason=_reason(error)).inc()
                log.warning(
                    "send failed, will retry", extra=_fields(event, "retry", attempt, error)
                )
                held_back = held_back or event
                blocked, next_seq = True, event.seq
                delay = self._retry_later(event, attempt, error, out)
                continue
            reason = _discard_reason(event, verdict, error)
            copy_verdict, copy_error = copies.get(id(event), _COPY_NOT_SENT)
            if copy_verdict != DELIVERED:
                log.error(
                    "dead-letter copy failed",
                    extra=_fields(
                        event,
                        "dead_letter_failed",
                        attempt,
                        copy_error,
                        to=self.settings.dead_letter_topic,
                    ),
                )
            if copy_verdict == RETRIABLE:
                # The dead-letter copy did not make it yet: keep the event, retry later.
                held_back = held_back or event
                blocked, next_seq = True, event.seq
                delay = self._retry_later(event, attempt, copy_error, out)
                continue
            if copy_verdict == PERMANENT:
                # No copy can ever be made (e.g. too large for the dead-letter topic too):
                # the row itself, discarded with its reason, is what remains.
                reason = f"{reason}; dead-letter copy impossible: {copy_error}"
            out.append(
                EventOutcome(event.event_id, ck.key, "discarded", 1, 0.0, None, None, reason)
            )
            self.metrics.discarded.labels(topic=event.topic, reason=_reason(error)).inc()
            log.error(
                "event discarded", extra=_fields(event, "discard", attempt, reason, parked=park)
            )
            if park:
                held_back = held_back or event
                blocked = True
                parked = True
                next_seq = event.seq
        # Every claimed event was due, and the key had nothing more visible when
        # claimed: fewer events than asked for, or all it had been handed out.
        drained = (
            not ck.withheld
            and len(due) == len(ck.events)
            and (len(ck.events) < per_key_limit or ck.waiting_beyond_claim == 0)
        )
        exhausted_key = drained and not blocked and not parked
        return KeyOutcome(ck.key, next_seq, delay, parked, exhausted_key)

    def _order_violated(self, earlier: ClaimedEvent, later: ClaimedEvent) -> None:
        """Count and log a later event of a key that Kafka took while an earlier one failed.

        The relay sends one topic per key per batch and relies on the idempotent
        producer's per-partition order, so this needs a broker that rejected one
        record batch (a check the relay could not make: a broker-side size limit
        below the relay's, broker-side validation) and took a later one.
        """
        self.metrics.order_violations.labels(topic=later.topic).inc()
        log.error(
            "a later event of a key reached Kafka while an earlier one did not",
            extra={
                "action": "order_violation",
                "key": later.key,
                "event_id": later.event_id,
                "earlier_event_id": earlier.event_id,
                "topic": later.topic,
            },
        )

    def _retry_later(
        self, event: ClaimedEvent, attempt: int, error: str | None, out: list[EventOutcome]
    ) -> float:
        """Record one more failed attempt and return the backoff before the next."""
        settings = self.settings
        backoff = backoff_delay(attempt, settings.backoff_base, settings.backoff_cap, self._rng)
        out.append(
            EventOutcome(event.event_id, event.key, "pending", 1, backoff, None, None, error)
        )
        return backoff

    # Waiting, retrying, housekeeping -------------------------------------------

    def _stay_busy(self) -> None:
        """After a cycle that did something: no wake-ups wanted, none left unread.

        Producers stop notifying once the wake lock is let go. The
        notifications sent meanwhile are of no use, but unread they would pin
        the server's notification queue, which every application of the
        cluster shares.
        """
        try:
            self.store.announce_busy()
            self.store.drop_wakeups()
        except StorageError as exc:
            log.warning(
                "could not read notifications", extra={"action": "db_error", "error": str(exc)}
            )

    def _idle_wait(self) -> None:
        """After a cycle with nothing to do: wait for a wake-up or ``poll_interval``.

        The first time, announce the relay idle (take the wake lock) and look
        for work once more instead of waiting: what producers committed
        before the lock was taken did not notify. When another relay is the
        idle one, its wake-ups reach this relay too; when a producer's long
        transaction holds the lock, wait only briefly before trying again.
        """
        self.publisher.poll()  # statistics and librdkafka logs, also while idle
        timeout = self.settings.poll_interval
        if not self.settings.listen:
            self._stop.wait(timeout)
            return
        # The last look must be a claim made now, not one read ahead.
        self._release_prefetched()
        try:
            if not self.store.idle_announced:
                if self.store.announce_idle(_IDLE_LOCK_WAIT):
                    return
                if not self.store.another_relay_idle():
                    timeout = min(timeout, _IDLE_LOCK_WAIT)
            # In slices, so that stop() is heard within one whatever the poll
            # interval; a relay without the lock tries it again at each, since the
            # relay that holds it may stop or go busy at any time.
            deadline = time.monotonic() + timeout
            while not self._stop.is_set():
                left = deadline - time.monotonic()
                if left <= 0 or self.store.wait_for_wakeup(min(left, _STOP_CHECK)):
                    break
                if not self.store.idle_announced and self.store.announce_idle(0.001):
                    break  # now the idle one: look for work once more
        except StorageError:
            self._stop.wait(timeout)

    def _with_db_retry(
        self,
        action: Callable[[], T],
        *,
        stop_on_shutdown: bool,
        give_up: Callable[[], bool] = lambda: False,
    ) -> T:
        """Run a database step, retrying transient failures with backoff.

        Claims give up when the relay is stopping; recording an outcome keeps
        trying until the shutdown deadline, since Kafka already has the messages.
        ``give_up`` may end the retries sooner.
        """

        def should_stop(state: RetryCallState) -> bool:
            if give_up():
                return True
            return self._stop.is_set() if stop_on_shutdown else self._past_shutdown_deadline()

        def before_sleep(state: RetryCallState) -> None:
            exc = state.outcome.exception() if state.outcome else None
            self.metrics.db_errors.inc()
            log.warning(
                "database error, retrying",
                extra={"action": "db_retry", "attempt": state.attempt_number, "error": str(exc)},
            )

        retrying = Retrying(
            retry=retry_if_exception_type(StorageError),
            wait=wait_exponential_jitter(multiplier=0.1, max=5.0, jitter=0.1),
            stop=should_stop,
            before_sleep=before_sleep,
            sleep=lambda seconds: self._interruptible_sleep(seconds, stop_on_shutdown),
            reraise=True,
        )
        return retrying(action)

    def _interruptible_sleep(self, seconds: float, stop_on_shutdown: bool) -> None:
        if stop_on_shutdown:
            self._stop.wait(seconds)
        else:
            time.sleep(seconds)

    def _purge_loop(self) -> None:
        """Retention, in its own thread so large purges never delay publishing."""
        while not self._stop.wait(self._purge_delay()):
            self.purge_once()

    def _purge_delay(self) -> float:
        # Spread relays' purges apart; the first runs soon after start.
        if self._last_purge == 0.0:
            self._last_purge = time.monotonic()
            return min(self.settings.purge_interval, 10.0) * self._rng.random()
        return self.settings.purge_interval

    def purge_once(self) -> None:
        """Delete delivered and discarded events past their retention, in bounded batches."""
        try:
            removed = self.store.purge(
                delivered_seconds=self.settings.retain_delivered_seconds,
                discarded_seconds=self.settings.retain_discarded_seconds,
                batch=self.settings.purge_batch,
            )
        except StorageError as exc:
            log.warning("purge failed", extra={"action": "purge_failed", "error": str(exc)})
            return
        if removed:
            self.metrics.purged.inc(removed)
            log.info("purged old events", extra={"action": "purge", "events": removed})


def _add(total: CycleReport, report: CycleReport) -> None:
    for name in vars(total):
        setattr(total, name, getattr(total, name) + getattr(report, name))


def _fields(
    event: ClaimedEvent, action: str, attempt: int, error: str | None, **more: object
) -> dict[str, object]:
    """The structured fields of a log record about one event."""
    return {
        "action": action,
        "event_id": event.event_id,
        "key": event.key,
        "topic": event.topic,
        "attempt": attempt,
        "error": error,
        **more,
    }


def _reason(error: str | None) -> str:
    """A low-cardinality label for an error message: its leading error name."""
    if not error:
        return "unknown"
    head = error.split(":", 1)[0].strip()
    return head if head.replace("_", "").isalnum() and len(head) <= 40 else "other"
