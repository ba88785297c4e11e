"""The relay loop: claim a batch, publish it, record the outcome, repeat.

One cycle is: claim (one short transaction, :mod:`~outbox_kafka.relay.claim`)
-> check and produce every claimed event -> wait once for all delivery reports
(:mod:`~outbox_kafka.relay.send`) -> record the outcome (one fenced statement in
the store). No transaction is open while messages are in flight. What to send
and what becomes of each event is decided in :mod:`~outbox_kafka.relay.decide`;
this module keeps the lifecycle, the pipeline and the record step, the database
steps' retries through transient failures (:class:`DatabaseRetry`), and the
supervised side loops (:class:`SupervisedLoop`): the backlog sampler and
retention (:class:`Retention`, the relay's purge of delivered events, through the
store's :func:`outbox_kafka.purging.purge_old_events`, which ``outbox-kafka purge``
shares). The producer API never imports it.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from functools import partial
from typing import TypeVar

from tenacity import RetryCallState, Retrying, retry_if_exception_type, wait_exponential_jitter

from outbox_kafka.errors import StorageError
from outbox_kafka.relay.batch import Claim, CycleReport, DrainResult, EventStatus, KeyOutcome
from outbox_kafka.relay.claim import Claimed, Claimer, worth_reading_ahead
from outbox_kafka.relay.config import RelaySettings, redact_kafka_config
from outbox_kafka.relay.decide import RetryPolicy
from outbox_kafka.relay.lease import Lease
from outbox_kafka.relay.metrics import BacklogSampler, RelayMetrics
from outbox_kafka.relay.observe import LogObserver, Observers, RelayObserver, SendTracing
from outbox_kafka.relay.ports import ClaimStore, KafkaReader, MessagePublisher
from outbox_kafka.relay.recover import FLOOR_RETENTION_SECONDS, PartitionReader, Recovery
from outbox_kafka.relay.send import BatchSender, Publisher, SentBatch
from outbox_kafka.relay.store import Store
from outbox_kafka.relay.wake import Waiting

log = logging.getLogger("outbox_kafka.relay")

T = TypeVar("T")


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
        store: ClaimStore | None = None,
        publisher: MessagePublisher | None = None,
        tracer_provider: object | None = None,
        observers: Sequence[RelayObserver] = (),
        reader: KafkaReader | None = None,
    ) -> None:
        """``store``, ``publisher`` and ``reader`` replace the relay's own (tests pass
        fakes through them). A relay given a publisher reads Kafka back for keys in
        doubt only when it is given a ``reader`` too; without one it is at least once."""
        self.settings = settings
        self.metrics = metrics or RelayMetrics()
        self.metrics.set_info(settings)
        #: Who hears what the relay announces: its metrics, its logs and its traces,
        #: then the ``observers`` it was given.
        self.observer = Observers(
            [
                self.metrics,
                LogObserver(
                    park=settings.on_exhausted == "park",
                    dead_letter_topic=settings.dead_letter_topic,
                ),
                SendTracing(tracer_provider),
                *observers,
            ]
        )
        self.store: ClaimStore = store or Store(settings.database_url, settings.names)
        self.publisher: MessagePublisher = publisher or Publisher.for_settings(
            settings, self.metrics.observe_librdkafka_stats
        )
        self._stop = threading.Event()
        self._stop_deadline: float | None = None
        self.policy = RetryPolicy.from_settings(settings)
        self._db = DatabaseRetry(self._stop, self._past_shutdown_deadline, self.observer)
        self.lease = Lease(settings.lease_seconds, settings.effective_delivery_timeout_ms / 1000)
        if reader is None and publisher is None:
            reader = PartitionReader(settings.admin_config())
        #: Exactly once across crashes: the relay's sessions and their floors, and
        #: the read-back of keys in doubt (None: at least once).
        self.recovery = (
            None
            if reader is None
            else Recovery(
                self.store,
                self.publisher,
                reader,
                observer=self.observer,
                dead_letter_topic=settings.dead_letter_topic,
                resend_unproven=settings.on_unproven == "send",
            )
        )
        self._claim_step = Claimer(
            self._take_claim,
            batch_size=settings.batch_size,
            max_message_bytes=self.publisher.max_message_bytes,
            observer=self.observer,
        )
        self._sender = BatchSender(
            self.publisher,
            self.policy,
            self.observer,
            dead_letter_topic=settings.dead_letter_topic,
            lease=self.lease,
            abort=self._past_shutdown_deadline,
            recovery=self.recovery,
        )
        self._last_cycle_at: float | None = None
        #: What this relay's records did, summed as each batch is recorded (see
        #: :attr:`recorded`), and the lock the loop and the recorder share for it.
        self._recorded = CycleReport()
        self._recorded_lock = threading.Lock()
        self._waiting = Waiting(
            self.store.wakeups() if settings.listen else None, settings.poll_interval, self._stop
        )
        self._retention = Retention(
            self.store, settings, self.observer, self.policy.rng, floors=self.recovery is not None
        )
        self.metrics.watch_last_cycle(lambda: self.last_cycle_at)
        # One batch's outcome is recorded here while the next batch is sent:
        # the database and Kafka work overlap, and a key is never in two
        # batches at once because its lease holds until its record is done.
        self._recorder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="outbox-record")
        self._recording: Future[CycleReport] | None = None
        # Likewise the next claim is read while a batch is being sent. Its keys
        # are leased like any claim's; a claim that is never sent is released.
        self._claimer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="outbox-claim")
        self._claiming: Future[Claimed] | None = None

    @property
    def last_cycle_at(self) -> float | None:
        """``time.monotonic()`` when the last cycle finished; None before the first."""
        return self._last_cycle_at

    @property
    def recorded(self) -> CycleReport:
        """What every batch this relay has recorded did, summed (a copy).

        Counted as each record commits, so it holds what a :meth:`drain` or
        :meth:`drain_all` that raised had done by then; after :meth:`close`, the
        last batch's record too. Claims handed back unsent are not counted.
        """
        with self._recorded_lock:
            return replace(self._recorded)

    @property
    def waiting_on_database(self) -> bool:
        """Whether a database step is retrying: the loop waits for the database, not stuck."""
        return self._db.waiting

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
        purger = SupervisedLoop(
            "purge", self.purge_once, self._retention.delay, self.observer, stop_event=self._stop
        ).start()
        sampler = BacklogSampler(self.settings, self.observer)
        sampling = SupervisedLoop(
            "sampler", sampler.sample_once, sampler.delay, self.observer
        ).start()
        try:
            while not self._stop.is_set():
                _, progressed = self._guarded_cycle()
                if progressed:
                    self._waiting.stay_busy()
                else:
                    self.publisher.poll()  # statistics and librdkafka logs, also while idle
                    # The last look before waiting must be a claim made now.
                    self._release_prefetched()
                    self._waiting.idle()
        finally:
            # Also after an error: the shutdown deadline bounds the last records.
            self.stop()
            purger.stop()
            sampling.stop()
            sampler.stop()
            self.close()
            log.info("relay stopped", extra={"action": "stop", "relay_id": self.settings.relay_id})

    def drain(self) -> CycleReport:
        """Publish everything due now, then return what was done (the relay stays open)."""
        total = CycleReport()
        while not self._stop.is_set():
            report, progressed = self._guarded_cycle()
            total.add(report)
            if not progressed:
                # Nothing was claimed, or only keys with nothing due: all due work is done.
                break
        self._release_prefetched()
        total.add(self._await_recording() or CycleReport())
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
            total.add(self.drain())
            try:
                left = self._db.run(
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
        try:
            self._release_prefetched()
        finally:
            self._await_recording()
        self._claimer.shutdown(wait=True)
        self._recorder.shutdown(wait=True)
        self.publisher.close(timeout=min(5.0, self.settings.shutdown_timeout))
        if self.recovery is not None:
            self.recovery.close_reader()
        self._waiting.close()
        self.store.close()

    def abandon(self) -> None:
        """Let the relay go as a crash would: its background claim and record are not
        waited for, nothing more is released or recorded, and its store and producer
        stay open. For tests that kill a relay in place; a relay that is done with
        calls :meth:`close`."""
        self._claimer.shutdown(wait=False)
        self._recorder.shutdown(wait=False)

    # The cycle ---------------------------------------------------------------

    def _guarded_cycle(self) -> tuple[CycleReport, bool]:
        """One pipelined cycle: (what finished recording meanwhile, whether anything moved).

        While this cycle's batch is sent, the next claim is read on its own
        connection and the previous batch is recorded on a third; this batch's
        record is handed to the background once the previous one has committed.
        So at most two batches of a relay loop are sent and not yet recorded at
        any moment (the one being sent and the one being recorded): what a
        killed relay leaves to the read-back of the keys' next holder. A key is
        never in two batches at once: its lease holds from its claim until its
        record, and the next claim is taken while this batch's keys are leased.
        When the previous record failed for good (past the shutdown deadline),
        this batch's is still tried, and no claim after it is sent.
        """
        done = CycleReport()
        try:
            claimed = self._next_claim()
        except StorageError as exc:
            # The claim already retried; only a stop request gets us here.
            log.warning("database unavailable", extra={"action": "db_error", "error": str(exc)})
            done.add(self._await_recording() or CycleReport())
            return done, False
        claim, asked = claimed.claim, claimed.asked
        if not self._stop.is_set() and worth_reading_ahead(claim, asked, self.settings.batch_size):
            self._claiming = self._claimer.submit(self._claim_step.claim)
        claim, sent = self._send(claimed)
        previous = self._await_recording()
        if previous is not None:
            done.add(previous)
        if sent.sent:
            self._recording = self._recorder.submit(self._record, claim, sent)
            return done, True
        if previous is None:
            return done, False
        try:
            report = self._record(claim, sent)
        except StorageError as exc:
            # Only past the shutdown deadline; nothing of this claim was sent.
            log.warning(
                "could not record a batch before shutdown; its keys wait for their lease",
                extra={"action": "db_error", "error": str(exc)},
            )
            return done, False
        done.add(report)
        # Keys just released by the previous record may have more work, and keys
        # producers added may not all have joined the queue yet: go again.
        return done, report.progressed or previous.progressed or self.store.arrivals_left

    def cycle(self) -> CycleReport:
        """One claim -> publish -> record round, recorded before it returns."""
        report = self._await_recording()
        if report is None:
            return CycleReport()  # not sent: see _guarded_cycle
        report.add(self._record(*self._send(self._next_claim())))
        return report

    def _next_claim(self) -> Claimed:
        """The claim read ahead during the last cycle, or a new one."""
        claiming, self._claiming = self._claiming, None
        if claiming is not None:
            claimed = claiming.result()
            if self.lease.still_usable(claimed.asked_at):
                return claimed
            # It waited behind a slow send: what is left of its lease would not
            # cover a send of its own, so its keys could pass to another relay
            # while their messages are still in flight. Claim them afresh.
            self.observer.read_ahead_released(len(claimed.claim.keys))
            self._release(claimed.claim)
        return self._claim_step.claim()

    def _take_claim(self, max_keys: int) -> Claim:
        """The store's claim of up to ``max_keys`` keys, retried until it succeeds or the
        relay stops."""
        claim = partial(
            self.store.claim,
            batch_size=self.settings.batch_size,
            lease_seconds=self.settings.lease_seconds,
            max_keys=max_keys,
            max_bytes=self.settings.max_claim_bytes,
        )
        if self.recovery is None:
            return self._db.run(claim, stop_on_shutdown=True)
        recovery = self.recovery
        return self._db.run(lambda: claim(session=recovery.session()), stop_on_shutdown=True)

    def _send(self, claimed: Claimed) -> tuple[Claim, SentBatch]:
        """The send step: the next claim is sized after this one, then it is sent."""
        self._claim_step.adapt(claimed)
        return self._sender.send_claimed(claimed)

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
        release = [KeyOutcome.unchanged(k) for k in claim.keys]
        try:
            self._record(claim, SentBatch(keys=release), counted=False)
        except StorageError as exc:
            # Only past the shutdown deadline: nothing was sent, the keys wait for their lease.
            log.warning(
                "could not release a claim before shutdown; its keys wait for their lease",
                extra={"action": "db_error", "error": str(exc)},
            )

    def _await_recording(self) -> CycleReport | None:
        """Wait for the outstanding background record, if any, and return its report;
        None if it could not be recorded."""
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
            return None

    def _record(self, claim: Claim, sent: SentBatch, *, counted: bool = True) -> CycleReport:
        """The record step: a sent batch's outcome in one fenced statement, counted
        (in :attr:`recorded` too, unless not ``counted``: a claim handed back unsent)."""
        report = CycleReport(keys=len(claim.keys), sent=sent.sent)
        if not claim.keys:
            self._last_cycle_at = time.monotonic()
            return report
        started = time.monotonic()
        doubts = sent.doubts
        recovery = self.recovery
        if (
            doubts is not None
            and doubts.floors
            and not (recovery and recovery.is_open(doubts.session))
        ):
            # A batch of the session may be on Kafka unrecorded: its floors stay.
            doubts = replace(doubts, floors={})
        try:
            result = self._db.run(
                lambda: (
                    self.store.record(claim.token, sent.keys, sent.events)
                    if doubts is None
                    else self.store.record(claim.token, sent.keys, sent.events, doubts)
                ),
                stop_on_shutdown=False,
            )
        except StorageError:
            if self.recovery is not None and sent.sent:
                # The batch stays on Kafka unrecorded: the next batch of its session,
                # sent meanwhile, must not raise the floors past it.
                self.recovery.close(claim.session)
            raise
        self.observer.recorded(result, time.monotonic() - started)
        report.keys_removed = result.keys_removed
        report.delivered = result.delivered
        report.retried = result.retried
        report.discarded = result.discarded
        report.leases_lost = len(sent.keys) - result.keys_owned
        if report.leases_lost:
            if self.recovery is not None:
                # Its heirs read the session back from its floors: they stay where they are.
                self.recovery.close(claim.session)
            self.observer.lease_lost(report.leases_lost)
            acknowledged = sum(1 for e in sent.events if e.status == EventStatus.DELIVERED)
            if acknowledged > result.delivered:
                self.observer.acknowledged_unrecorded(acknowledged - result.delivered)
        if counted:
            with self._recorded_lock:
                self._recorded.add(report)
        self._last_cycle_at = time.monotonic()
        return report

    def purge_once(self) -> None:
        """Delete delivered and discarded events past their retention, in bounded batches."""
        self._retention.run_once()


#: A database step unanswered this long counts as waiting for the database.
SLOW_STEP_SECONDS = 5.0


class DatabaseRetry:
    """Runs a database step until it succeeds or the relay may give it up.

    Claims give up when the relay is stopping; recording an outcome keeps
    trying until the shutdown deadline, since Kafka already has the messages.
    """

    def __init__(
        self,
        stopping: threading.Event,
        past_shutdown_deadline: Callable[[], bool],
        observer: RelayObserver,
    ) -> None:
        self._stopping = stopping
        self._past_deadline = past_shutdown_deadline
        self._observer = observer
        #: By thread (the claim and the record run on their own): when its step began.
        self._running_since: dict[int, float] = {}
        #: Threads whose step failed and waits to be retried.
        self._failing: set[int] = set()

    @property
    def waiting(self) -> bool:
        """Whether a step waits for the database: failed and retrying, or long unanswered.

        A connection to a host that vanished without a reset hangs until the
        operating system gives up, with no error to retry on meanwhile.
        """
        now = time.monotonic()
        running = list(self._running_since.values())
        return bool(self._failing) or any(now - began > SLOW_STEP_SECONDS for began in running)

    def run(
        self,
        action: Callable[[], T],
        *,
        stop_on_shutdown: bool,
        give_up: Callable[[], bool] = lambda: False,
    ) -> T:
        """``action()``, retried on StorageError; ``give_up`` may end the retries sooner."""
        me = threading.get_ident()

        def should_stop(state: RetryCallState) -> bool:
            if give_up():
                return True
            return self._stopping.is_set() if stop_on_shutdown else self._past_deadline()

        def before_sleep(state: RetryCallState) -> None:
            exc = state.outcome.exception() if state.outcome else None
            self._observer.database_retry(state.attempt_number, exc)
            self._failing.add(me)

        def sleep(seconds: float) -> None:
            if stop_on_shutdown:
                self._stopping.wait(seconds)
            else:
                time.sleep(seconds)

        retrying = Retrying(
            retry=retry_if_exception_type(StorageError),
            wait=wait_exponential_jitter(multiplier=0.1, max=5.0, jitter=0.1),
            stop=should_stop,
            before_sleep=before_sleep,
            sleep=sleep,
            reraise=True,
        )
        self._running_since[me] = time.monotonic()
        try:
            return retrying(action)
        finally:
            self._running_since.pop(me, None)
            self._failing.discard(me)


class SupervisedLoop:
    """Runs ``step`` in a daemon thread, waiting ``delay()`` seconds before each
    run, until :meth:`stop` (or ``stop_event``) is set."""

    def __init__(
        self,
        name: str,
        step: Callable[[], object],
        delay: Callable[[], float],
        observer: RelayObserver,
        *,
        stop_event: threading.Event | None = None,
    ) -> None:
        self.name = name
        self._step = step
        self._delay = delay
        self._observer = observer
        self._stop = stop_event or threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"outbox-{name}", daemon=True)

    def start(self) -> SupervisedLoop:
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Ask the loop to end and wait up to ``timeout`` seconds for its step to finish."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        while not self._stop.wait(self._delay()):
            self.run_step()

    def run_step(self) -> None:
        """Run one step now; an error is logged and counted, never raised."""
        try:
            self._step()
        except Exception as exc:
            self._observer.background_failed(self.name, exc)


class Retention:
    """The relay's purge task: when to purge next, and one purge."""

    def __init__(
        self,
        store: ClaimStore,
        settings: RelaySettings,
        observer: RelayObserver,
        rng: random.Random,
        *,
        floors: bool = False,
    ) -> None:
        self._store = store
        self._settings = settings
        self._observer = observer
        self._rng = rng
        self._first = True
        #: Whether old relay sessions' floors are forgotten too.
        self._floors = floors

    def delay(self) -> float:
        """Seconds to the next purge: spread relays' purges apart; the first comes soon."""
        if self._first:
            self._first = False
            return min(self._settings.purge_interval, 10.0) * self._rng.random()
        return self._settings.purge_interval

    def run_once(self) -> None:
        """Delete delivered and discarded events past their retention, in bounded batches."""
        settings = self._settings
        try:
            removed = self._store.purge(
                delivered_seconds=settings.retain_delivered_seconds,
                discarded_seconds=settings.retain_discarded_seconds,
                batch=settings.purge_batch,
            )
            if self._floors:
                self._store.forget_floors(FLOOR_RETENTION_SECONDS)
        except StorageError as exc:
            self._observer.purge_failed(exc)
            return
        if removed:
            self._observer.purge_done(removed)
