"""OpenTelemetry: a request's span -> enqueue -> the relay -> a consumer's span, one trace."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import sqlalchemy as sa
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from outbox_kafka import Event
from outbox_kafka.relay.loop import Relay
from tests.relay_support import consume_all, make_settings, topic_outbox

PROPAGATOR = TraceContextTextMapPropagator()


@pytest.fixture
def spans() -> Iterator[tuple[TracerProvider, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider, exporter
    provider.shutdown()


def _by_name(finished: tuple[ReadableSpan, ...], name: str) -> list[ReadableSpan]:
    return [s for s in finished if s.name == name]


def test_a_request_trace_continues_through_the_outbox_to_the_consumer(
    engine: sa.Engine,
    database_url: str,
    kafka_bootstrap: str,
    new_topic: Callable[..., str],
    spans: tuple[TracerProvider, InMemorySpanExporter],
) -> None:
    provider, exporter = spans
    tracer = provider.get_tracer("shop")
    topic = new_topic(partitions=2)
    outbox = topic_outbox()
    with (
        tracer.start_as_current_span("POST /orders", kind=trace.SpanKind.SERVER),
        engine.begin() as conn,
    ):
        outbox.enqueue(conn, type="order.created", key="o-1", data={}, topic=topic)
        outbox.enqueue_many(conn, [Event(type="order.paid", key="o-1", data={}, topic=topic)] * 2)
    # An event written outside any span starts a trace of its own at the relay.
    with engine.begin() as conn:
        lone = outbox.enqueue(conn, type="order.created", key="o-2", data={}, topic=topic)

    relay = Relay(make_settings(database_url, kafka_bootstrap), tracer_provider=provider)
    try:
        relay.drain()
    finally:
        relay.close()
    records = consume_all(kafka_bootstrap, topic, 4)
    for record in records:
        parent = PROPAGATOR.extract({"traceparent": record.headers["traceparent"].decode()})
        with tracer.start_as_current_span(
            f"process {topic}", context=parent, kind=trace.SpanKind.CONSUMER
        ):
            pass

    finished = exporter.get_finished_spans()
    (request,) = _by_name(finished, "POST /orders")
    sends = _by_name(finished, f"send {topic}")
    processes = _by_name(finished, f"process {topic}")
    assert len(sends) == 4 and len(processes) == 4
    by_id = {s.context.span_id: s for s in sends}
    request_trace = request.context.trace_id
    in_request = [s for s in sends if s.context.trace_id == request_trace]
    assert len(in_request) == 3
    for send in in_request:
        assert send.parent is not None and send.parent.span_id == request.context.span_id
    (alone,) = [s for s in sends if s.context.trace_id != request_trace]
    assert alone.parent is None
    assert alone.attributes is not None
    assert alone.attributes["messaging.message.id"] == str(lone)
    for process in processes:
        assert process.parent is not None
        send = by_id[process.parent.span_id]  # each consumer span's parent is a relay span
        assert process.context.trace_id == send.context.trace_id
    for send in sends:
        assert send.kind is trace.SpanKind.PRODUCER
        attributes = dict(send.attributes or {})
        assert attributes["messaging.system"] == "kafka"
        assert attributes["messaging.operation.type"] == "send"
        assert attributes["messaging.destination.name"] == topic
        assert attributes["messaging.kafka.message.key"] in ("o-1", "o-2")
        assert attributes["messaging.destination.partition.id"] in ("0", "1")
        assert isinstance(attributes["messaging.kafka.offset"], int)
        assert attributes.get("messaging.batch.message_count", 1) >= 1
    ids = {r.event_id for r in records}
    assert {str(send.attributes["messaging.message.id"]) for send in sends} == ids  # type: ignore[index]
    # The envelope keeps the producer's context; the header carries the relay's span.
    for record in records:
        if record.key == "o-1":
            envelope_parent = record.value["traceparent"].split("-")[2]
            assert envelope_parent == format(request.context.span_id, "016x")


def test_without_a_tracer_provider_the_stored_traceparent_is_sent_as_it_is(
    engine: sa.Engine,
    database_url: str,
    kafka_bootstrap: str,
    new_topic: Callable[..., str],
) -> None:
    topic = new_topic(partitions=1)
    given = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    with engine.begin() as conn:
        topic_outbox().enqueue(conn, type="t.e", key="k", data={}, topic=topic, traceparent=given)
        topic_outbox().enqueue(conn, type="t.e", key="k", data={}, topic=topic)
    relay = Relay(make_settings(database_url, kafka_bootstrap))
    try:
        relay.drain()
    finally:
        relay.close()
    records = sorted(consume_all(kafka_bootstrap, topic, 2), key=lambda r: r.offset)
    assert records[0].headers["traceparent"].decode() == given
    assert "traceparent" not in records[1].headers  # no span was current at enqueue
