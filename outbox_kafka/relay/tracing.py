"""OpenTelemetry spans for the relay's sends, when OpenTelemetry is installed and configured.

Each message gets a PRODUCER span named ``send <topic>``, a child of the
trace context stored with its event (the producer's, taken by ``enqueue``),
with the attributes of the OpenTelemetry messaging conventions for Kafka.
The message's ``traceparent`` header is rewritten to carry that span, so a
consumer's span continues the one trace from the request that wrote the
event. The span ends when the broker's delivery report comes, with the
partition and offset, or with an error status.

Spans are made only while a tracer provider is set (an SDK configured in
the process, or by ``opentelemetry-instrument``); otherwise, and without the
``otel`` extra, a send costs one check.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from outbox_kafka.relay.batch import Verdict
from outbox_kafka.relay.observe import RelayObserver
from outbox_kafka.relay.ports import Delivery, Message
from outbox_kafka.version import __version__

_TRACEPARENT = "traceparent"

_otel: Any
try:
    from opentelemetry import context as _context
    from opentelemetry import trace as _otel
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
except ImportError:  # the otel extra is not installed
    _otel = None


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
