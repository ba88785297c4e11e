"""What the relay announces, and who listens.

The relay's steps announce what happened (a claim taken, a batch sent, each key
settled with its retries, holds, discards and order violations, a record, a lease
lost, a database step retried, a purge, a backlog sample, ...) to one
:class:`RelayObserver`. Cross-cutting concerns subscribe by overriding the
announcements they care about, every other one being a no-op:

- :class:`~outbox_kafka.relay.metrics.RelayMetrics`: the Prometheus metrics;
- :class:`LogObserver`: the structured log lines (``extra={"action": ...}``);
- :class:`SendTracing`: OpenTelemetry spans, the one subscriber that changes what
  is sent (each message's ``traceparent``).

Each message gets a PRODUCER span named ``send <topic>``, a child of the trace
context stored with its event (the producer's, taken by ``enqueue``), with the
attributes of the OpenTelemetry messaging conventions for Kafka. The message's
``traceparent`` header is rewritten to carry that span, so a consumer's span
continues the one trace from the request that wrote the event. The span ends
when the broker's delivery report comes, with the partition and offset, or with
an error status. Spans are made only while a tracer provider is set (an SDK
configured in the process, or by ``opentelemetry-instrument``); otherwise, and
without the ``otel`` extra, a send costs one check.

:class:`Observers` hands each announcement to several subscribers, in order. A
:class:`~outbox_kafka.relay.loop.Relay` builds the default ones (its metrics, its
logs, its traces) and adds those it is given.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from outbox_kafka.relay.batch import Verdict
from outbox_kafka.relay.decide import (
    Discard,
    Hold,
    OrderViolation,
    Retry,
    Settlement,
    error_label,
)
from outbox_kafka.relay.ports import Delivery, Message
from outbox_kafka.version import __version__

if TYPE_CHECKING:
    from outbox_kafka.relay.batch import Claim, ClaimedEvent, ReadBackReport, RecordResult


_TRACEPARENT = "traceparent"

_otel: Any
try:
    from opentelemetry import context as _context
    from opentelemetry import trace as _otel
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
except ImportError:  # the otel extra is not installed
    _otel = None

log = logging.getLogger("outbox_kafka.relay")
sampler_log = logging.getLogger("outbox_kafka.sampler")

#: Holds of one topic for one reason are logged at most this often (all are counted).
HOLD_LOG_SECONDS = 60.0

#: A subscriber that keeps raising in one announcement is reported at most this often.
OBSERVER_FAILURE_SECONDS = 10.0


class RelayObserver:
    """Every announcement of the relay, each a no-op: subscribers override what they need.

    Announcements come from the relay's threads (the loop, the background record,
    the claim read ahead, the side loops); a subscriber keeping state guards it.
    """

    # The cycle ---------------------------------------------------------------

    def claimed(self, claim: Claim, seconds: float) -> None:
        """A claim was taken in ``seconds``."""

    def before_send(self, messages: list[Message]) -> list[Message]:
        """The messages about to be handed to the producer; returns what to send instead
        (the same messages, their headers possibly changed)."""
        return messages

    def after_send(self, messages: list[Message], deliveries: Sequence[Delivery]) -> None:
        """What became of the messages :meth:`before_send` returned (one delivery each)."""

    def send_skipped(self, messages: int, lease_left: float) -> None:
        """``messages`` were not sent: ``lease_left`` seconds of the lease were too few."""

    def sending_alone(self, messages: int) -> None:
        """The broker refused record batches; ``messages`` are sent again one by one."""

    def sent(self, claim: Claim, seconds: float) -> None:
        """A claim's batch was sent (and its dead-letter copies) in ``seconds``."""

    def settled(self, settlement: Settlement) -> None:
        """One key's decisions after its batch: delivered events, retries, holds,
        discards, order violations (see :class:`~outbox_kafka.relay.decide.Settlement`)."""

    def settled_all(self, settlements: Sequence[Settlement]) -> None:
        """Every key's decisions after a batch, announced once per batch: by default
        :meth:`settled` for each key in turn. A subscriber that counts them overrides
        this to count the batch at once."""
        if _hears(self, "settled"):
            for settlement in settlements:
                self.settled(settlement)

    def recorded(self, result: RecordResult, seconds: float) -> None:
        """A batch's outcome was recorded in ``seconds``."""

    def lease_lost(self, keys: int) -> None:
        """Another relay took over ``keys`` while this relay's batch was in flight."""

    def read_ahead_released(self, keys: int) -> None:
        """A claim read ahead waited too long to be sent; its ``keys`` were released."""

    def read_back(self, report: ReadBackReport) -> None:
        """Kafka was read back for a claim's keys in doubt before they were sent."""

    def acknowledged_unrecorded(self, events: int) -> None:
        """Kafka acknowledged ``events`` of a batch whose keys another relay had taken
        over by its record: they may be on Kafka twice."""

    # The database and the side loops ----------------------------------------

    def database_retry(self, attempt: int, error: BaseException | None) -> None:
        """A database step failed (its ``attempt``-th try) and is retried."""

    def background_failed(self, task: str, error: Exception) -> None:
        """A step of the side loop ``task`` failed unexpectedly; the loop goes on."""

    def purge_done(self, events: int) -> None:
        """Retention deleted ``events`` events."""

    def purge_failed(self, error: Exception) -> None:
        """A purge failed; it runs again at its next interval."""

    def sampled(self, pending: int, oldest_age_seconds: float | None, parked_keys: int) -> None:
        """A backlog sample was taken: pending events, the oldest one's age, parked keys."""

    def violations_counted(self, violations: int) -> None:
        """The consistency violations were counted."""

    def sample_failed(self, what: str, error: Exception) -> None:
        """A sample (``what``: ``backlog`` or ``consistency``) failed."""


def _hears(observer: RelayObserver, announcement: str) -> bool:
    """Whether ``observer`` does something with ``announcement`` (its class or the
    instance itself has its own), rather than the base class's nothing."""
    return announcement in vars(observer) or getattr(type(observer), announcement) is not getattr(
        RelayObserver, announcement
    )


class Observers(RelayObserver):
    """Several subscribers as one: each announcement goes to each, in order."""

    def __init__(self, observers: Iterable[RelayObserver] = ()) -> None:
        self.observers: list[RelayObserver] = list(observers)
        #: By (subscriber, announcement): when its last failure was announced.
        self._failures: dict[tuple[int, str], float] = {}
        #: By ``id()`` of the messages being sent: what each subscriber's
        #: :meth:`before_send` returned, handed back to its :meth:`after_send`.
        self._sending: dict[int, list[list[Message]]] = {}
        self._lock = threading.Lock()

    def _each(self, announcement: str, *args: Any) -> None:
        for o in self.observers:
            try:
                getattr(o, announcement)(*args)
            except Exception as exc:
                self._failed(o, announcement, exc)

    def _failed(self, failing: RelayObserver, announcement: str, error: Exception) -> None:
        """A subscriber raised: the relay goes on, and the others hear of it as a
        background failure (logged with its traceback and counted), at most every
        :data:`OBSERVER_FAILURE_SECONDS` for one subscriber's announcement."""
        now = time.monotonic()
        with self._lock:
            last = self._failures.get((id(failing), announcement))
            if last is not None and now - last < OBSERVER_FAILURE_SECONDS:
                return
            self._failures[(id(failing), announcement)] = now
        task = f"observer {type(failing).__name__}.{announcement}"
        for o in self.observers:
            if o is not failing:
                with contextlib.suppress(Exception):
                    o.background_failed(task, error)

    def claimed(self, claim: Claim, seconds: float) -> None:
        self._each("claimed", claim, seconds)

    def before_send(self, messages: list[Message]) -> list[Message]:
        returned: list[list[Message]] = []
        for o in self.observers:
            try:
                messages = o.before_send(messages)
            except Exception as exc:
                self._failed(o, "before_send", exc)  # its change is left out
            returned.append(messages)
        with self._lock:
            self._sending[id(messages)] = returned
        return messages

    def after_send(self, messages: list[Message], deliveries: Sequence[Delivery]) -> None:
        with self._lock:
            returned = self._sending.pop(id(messages), None)
        for i, o in enumerate(self.observers):
            try:
                o.after_send(returned[i] if returned else messages, deliveries)
            except Exception as exc:
                self._failed(o, "after_send", exc)

    def send_skipped(self, messages: int, lease_left: float) -> None:
        self._each("send_skipped", messages, lease_left)

    def sending_alone(self, messages: int) -> None:
        self._each("sending_alone", messages)

    def sent(self, claim: Claim, seconds: float) -> None:
        self._each("sent", claim, seconds)

    def settled(self, settlement: Settlement) -> None:
        self._each("settled", settlement)

    def settled_all(self, settlements: Sequence[Settlement]) -> None:
        for o in self.observers:
            if type(o).settled_all is not RelayObserver.settled_all:
                try:
                    o.settled_all(settlements)
                except Exception as exc:
                    self._failed(o, "settled_all", exc)
            elif _hears(o, "settled"):
                # Key by key, each on its own: a key it fails on does not keep the
                # others from it, and the failure is its settled's.
                for settlement in settlements:
                    try:
                        o.settled(settlement)
                    except Exception as exc:
                        self._failed(o, "settled", exc)

    def recorded(self, result: RecordResult, seconds: float) -> None:
        self._each("recorded", result, seconds)

    def lease_lost(self, keys: int) -> None:
        self._each("lease_lost", keys)

    def read_ahead_released(self, keys: int) -> None:
        self._each("read_ahead_released", keys)

    def read_back(self, report: ReadBackReport) -> None:
        self._each("read_back", report)

    def acknowledged_unrecorded(self, events: int) -> None:
        self._each("acknowledged_unrecorded", events)

    def database_retry(self, attempt: int, error: BaseException | None) -> None:
        self._each("database_retry", attempt, error)

    def background_failed(self, task: str, error: Exception) -> None:
        self._each("background_failed", task, error)

    def purge_done(self, events: int) -> None:
        self._each("purge_done", events)

    def purge_failed(self, error: Exception) -> None:
        self._each("purge_failed", error)

    def sampled(self, pending: int, oldest_age_seconds: float | None, parked_keys: int) -> None:
        self._each("sampled", pending, oldest_age_seconds, parked_keys)

    def violations_counted(self, violations: int) -> None:
        self._each("violations_counted", violations)

    def sample_failed(self, what: str, error: Exception) -> None:
        self._each("sample_failed", what, error)


def event_fields(
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


class LogObserver(RelayObserver):
    """The relay's structured log lines, one per announcement worth a line.

    ``park``: whether a discard parks its key (said in the discard's line);
    ``dead_letter_topic``: where copies go (said when one fails).
    """

    def __init__(self, *, park: bool = False, dead_letter_topic: str | None = None) -> None:
        self.park = park
        self.dead_letter_topic = dead_letter_topic
        #: By (topic, reason label): when a hold was last logged, and holds since.
        self._holds_logged: dict[tuple[str, str], tuple[float | None, int]] = {}

    def send_skipped(self, messages: int, lease_left: float) -> None:
        log.warning(
            "too little of the lease left to send; the keys go back to the queue",
            extra={
                "action": "send_skipped",
                "messages": messages,
                "lease_left_seconds": round(max(0.0, lease_left), 3),
            },
        )

    def sending_alone(self, messages: int) -> None:
        log.warning(
            "the broker refused a record batch; sending its messages one by one",
            extra={"action": "send_alone", "messages": messages},
        )

    def settled(self, settlement: Settlement) -> None:
        """Log one key's decisions, in its sequence order."""
        for decision in settlement.decisions:
            if isinstance(decision, OrderViolation):
                self._order_violated(decision)
            elif isinstance(decision, Hold):
                self._held(decision)
            elif isinstance(decision, Retry) and decision.copy_failed:
                self._copy_failed(decision.event, decision.attempt, decision.error)
            elif isinstance(decision, Retry):
                self._retried(decision)
            elif isinstance(decision, Discard):
                self._discarded(decision)

    def _retried(self, retry: Retry) -> None:
        log.warning(
            "send failed, will retry"
            if retry.counted
            else "the producer was reset under the send; will retry, no attempt counted",
            extra=event_fields(retry.event, "retry", retry.attempt, retry.error),
        )

    def _held(self, hold: Hold) -> None:
        """Log a hold once a minute per topic and reason, with how many holds since:
        every held key is looked at again every few seconds."""
        event = hold.event
        label = error_label(hold.error)
        now = time.monotonic()
        logged_at, since = self._holds_logged.get((event.topic, label), (None, 0))
        if logged_at is not None and now - logged_at < HOLD_LOG_SECONDS:
            self._holds_logged[(event.topic, label)] = (logged_at, since + 1)
            return
        self._holds_logged[(event.topic, label)] = (now, 0)
        log.error(
            "event held until an operator fixes its topic; its key waits",
            extra=event_fields(event, "hold", event.attempts, hold.error, held_since_last=since),
        )

    def _discarded(self, discard: Discard) -> None:
        if discard.copy_failed is not None:
            self._copy_failed(discard.event, discard.attempt, discard.copy_failed[1])
        log.error(
            "event discarded",
            extra=event_fields(
                discard.event, "discard", discard.attempt, discard.reason, parked=self.park
            ),
        )

    def _order_violated(self, violation: OrderViolation) -> None:
        later = violation.later
        log.error(
            "a later event of a key reached Kafka while an earlier one did not",
            extra={
                "action": "order_violation",
                "key": later.key,
                "event_id": later.event_id,
                "earlier_event_id": violation.earlier.event_id,
                "topic": later.topic,
            },
        )

    def _copy_failed(self, event: ClaimedEvent, attempt: int, error: str | None) -> None:
        log.error(
            "dead-letter copy failed",
            extra=event_fields(
                event, "dead_letter_failed", attempt, error, to=self.dead_letter_topic
            ),
        )

    def lease_lost(self, keys: int) -> None:
        log.warning(
            "lease lost: another relay took over keys while this batch was in flight",
            extra={"action": "lease_lost", "keys": keys},
        )

    def read_ahead_released(self, keys: int) -> None:
        log.info(
            "claim read ahead outlived its use; released",
            extra={"action": "release", "keys": keys},
        )

    def read_back(self, report: ReadBackReport) -> None:
        extra = {
            "action": "read_back",
            "keys": report.keys,
            "partitions": report.partitions,
            "messages_read": report.read,
            "matched": report.matched,
            "unproven": report.unproven,
            "sent_unproven": report.resent_unproven,
            "absent": report.absent,
            "why_unproven": report.why_unproven,
            "compacted": report.compacted,
            "seconds": round(report.seconds, 3),
        }
        if report.compacted:
            log.warning(
                "keys in doubt on a compacted topic are sent again without a read-back "
                "(at least once for them)",
                extra=extra,
            )
        elif report.unproven:
            log.warning("read Kafka back for keys in doubt; some could not be proven", extra=extra)
        else:
            log.info("read Kafka back for keys in doubt", extra=extra)

    def acknowledged_unrecorded(self, events: int) -> None:
        log.warning(
            "Kafka acknowledged events of keys another relay had taken over: "
            "they may be on Kafka twice",
            extra={"action": "acknowledged_unrecorded", "events": events},
        )

    def database_retry(self, attempt: int, error: BaseException | None) -> None:
        log.warning(
            "database error, retrying",
            extra={"action": "db_retry", "attempt": attempt, "error": str(error)},
        )

    def background_failed(self, task: str, error: Exception) -> None:
        log.error(
            "background task failed; it runs again at its next interval",
            exc_info=error,
            extra={"action": "background_error", "task": task, "error": str(error)},
        )

    def purge_done(self, events: int) -> None:
        log.info("purged old events", extra={"action": "purge", "events": events})

    def purge_failed(self, error: Exception) -> None:
        log.warning("purge failed", extra={"action": "purge_failed", "error": str(error)})

    def sample_failed(self, what: str, error: Exception) -> None:
        message = "backlog sample failed" if what == "backlog" else "consistency count failed"
        sampler_log.warning(message, extra={"action": "sample_failed", "error": str(error)})


class SendTracing(RelayObserver):
    """Starts a span per message before a send and ends them with the delivery reports:
    the relay's OpenTelemetry subscriber (:meth:`before_send`, :meth:`after_send`).

    ``tracer_provider``: the provider to use; default the global one, looked
    up at each send (so a provider set after the relay started is used).
    """

    def __init__(self, tracer_provider: Any = None) -> None:
        self._provider = tracer_provider
        self._propagator = TraceContextTextMapPropagator() if _otel is not None else None
        #: By ``id()`` of the messages :meth:`before_send` returned: their spans.
        self._spans: dict[int, list[Any]] = {}
        self._lock = threading.Lock()

    def before_send(self, messages: list[Message]) -> list[Message]:
        traced, spans = self.start(messages)
        if spans:
            with self._lock:
                self._spans[id(traced)] = spans
        return traced

    def after_send(self, messages: list[Message], deliveries: Sequence[Delivery]) -> None:
        with self._lock:
            spans = self._spans.pop(id(messages), None)
        if spans:
            self.finish(spans, deliveries)

    def _tracer(self) -> Any:
        if _otel is None:
            return None
        provider = self._provider or _otel.get_tracer_provider()
        if isinstance(provider, _otel.ProxyTracerProvider | _otel.NoOpTracerProvider):
            return None  # no SDK configured: no spans to make
        return provider.get_tracer("outbox_kafka.relay", __version__)

    def start(self, messages: Sequence[Message]) -> tuple[list[Message], list[Any]]:
        """The messages with each one's span in its ``traceparent``, and the spans."""
        tracer = self._tracer()
        if tracer is None:
            return list(messages), []
        traced: list[Message] = []
        spans: list[Any] = []
        count = len(messages)
        for message in messages:
            stored = {name: value.decode("latin-1") for name, value in message.headers}
            parent = (
                self._propagator.extract({_TRACEPARENT: stored[_TRACEPARENT]})
                if _TRACEPARENT in stored and self._propagator is not None
                else _context.Context()
            )
            attributes: dict[str, Any] = {
                "messaging.system": "kafka",
                "messaging.operation.name": "send",
                "messaging.operation.type": "send",
                "messaging.destination.name": message.topic,
                "messaging.kafka.message.key": message.key.decode("utf-8", "replace"),
            }
            if message.event_id:
                attributes["messaging.message.id"] = message.event_id
            if count > 1:
                attributes["messaging.batch.message_count"] = count
            span = tracer.start_span(
                f"send {message.topic}",
                context=parent,
                kind=_otel.SpanKind.PRODUCER,
                attributes=attributes,
            )
            carrier: dict[str, str] = {}
            assert self._propagator is not None
            self._propagator.inject(carrier, context=_otel.set_span_in_context(span))
            headers = [(n, v) for n, v in message.headers if n != _TRACEPARENT]
            headers.append((_TRACEPARENT, carrier[_TRACEPARENT].encode()))
            traced.append(message._replace(headers=headers))
            spans.append(span)
        return traced, spans

    @staticmethod
    def finish(spans: Sequence[Any], deliveries: Sequence[Delivery]) -> None:
        """End each span with its message's fate (no spans: tracing is off)."""
        if not spans:
            return
        for span, delivery in zip(spans, deliveries, strict=True):
            if delivery.verdict is Verdict.DELIVERED:
                span.set_attribute("messaging.destination.partition.id", str(delivery.partition))
                span.set_attribute("messaging.kafka.offset", delivery.offset)
            else:
                error = delivery.error or ("not sent" if not delivery.sent else "no report")
                span.set_attribute("error.type", error.split(":", 1)[0])
                span.set_status(_otel.Status(_otel.StatusCode.ERROR, error))
            span.end()
