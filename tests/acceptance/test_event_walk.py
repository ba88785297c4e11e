"""One event's walk from ``enqueue`` to its delivered record, as the modules of the
package whose code runs for it (docs/architecture.md, "One event's walk")."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

import sqlalchemy as sa

from outbox_kafka import Outbox
from outbox_kafka.relay import Relay
from tests.relay_support import make_settings, rows

#: The modules that take the event a step further, in the order it passes them.
WALK = [
    "producer.outbox",  # Outbox.enqueue
    "producer.encoding",  # the outbox's rules: route, key, limits, schema
    "producer.envelope",  # the CloudEvents envelope and headers
    "producer.writing",  # the insert with the key's sequence number
    "relay.loop",  # the cycle
    "relay.claim",  # how much to claim; each event checked
    "relay.store",  # the claim and the fenced record
    "relay.decide",  # the plan, then the key's and the event's next state
    "relay.recover",  # its partition, and the session's floor there before the send
    "relay.send",  # the send under the lease; the producer and its delivery report
]

#: What those steps call on the way: types, shared helpers, and the subscribers
#: that hear what happened.
HELPERS = {
    "database",
    "producer.data",
    "producer.event",
    "producer.event_checks",
    "producer.ids",
    "producer.instruments",
    "producer.trace_context",
    "relay.batch",
    "relay.lease",
    "relay.metrics",
    "relay.observe",
    "relay.ports",
    "relay.topic_admin",
    "schema.statements",
    "stored_headers",
    "topic_names",
    "validation",
}


@contextmanager
def _modules_run(into: set[str]) -> Iterator[None]:
    """Collect the package's modules whose functions are called, on every thread."""

    def profile(frame: FrameType, event: str, _arg: Any) -> None:
        if event == "call":
            name = frame.f_globals.get("__name__", "")
            if name.startswith("outbox_kafka"):
                into.add(name)

    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        yield
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]


def test_one_events_walk(
    engine: sa.Engine, database_url: str, kafka_bootstrap: str, new_topic: Callable[..., str]
) -> None:
    topic = new_topic()
    outbox = Outbox(allow_unknown_types=True)
    relay = Relay(make_settings(database_url, kafka_bootstrap))
    # The relay's start-up (its producer, the topic's metadata) is not the event's walk.
    with engine.begin() as conn:
        outbox.enqueue(conn, type="warm.up", key="w", data={}, topic=topic)
    relay.drain()
    walked: set[str] = set()
    with _modules_run(walked):
        with engine.begin() as conn:
            outbox.enqueue(conn, type="order.created", key="k", data={"n": 1}, topic=topic)
        report = relay.drain()
    relay.close()
    assert report.delivered == 1
    assert rows(engine, "SELECT status FROM outbox WHERE ordering_key = 'k'") == [("delivered",)]
    # Exactly these modules ran for the event: a new one on the way belongs in the
    # walk (at most 10) or among the helpers, and in docs/architecture.md.
    assert sorted(m.removeprefix("outbox_kafka.") for m in walked) == sorted([*WALK, *HELPERS])
    assert len(WALK) <= 10
