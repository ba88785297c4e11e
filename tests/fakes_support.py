"""Helpers for the relay's tests on the in-memory fakes of outbox_kafka.testing: events
written into an InMemoryStore, and a relay on the fakes (no database, no broker)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from outbox_kafka.relay import Relay
from outbox_kafka.relay.observe import RelayObserver
from outbox_kafka.testing import InMemoryStore, StubPublisher
from tests.relay_support import make_settings

#: The database of a relay on the fakes. Only run()'s backlog sampler connects to it:
#: nothing listens there, so each sample fails at once (and is only logged).
NO_DATABASE = "postgresql://127.0.0.1:1/none"


def enqueue(store: InMemoryStore, key: str, n: int, topic: str = "t") -> list[str]:
    """Write ``n`` valid events of ``key`` into ``store``; their ids, in order."""
    outbox = store.outbox(source="/tests")
    return [
        str(outbox.enqueue(None, type="x.y", key=key, topic=topic, data={"i": i})) for i in range(n)
    ]


def relay_on_fakes(
    store: InMemoryStore,
    publisher: StubPublisher,
    observers: Sequence[RelayObserver] = (),
    **settings: Any,
) -> Relay:
    """A relay on ``store`` and ``publisher``, with the test settings of
    :func:`tests.relay_support.make_settings` and ``settings`` over them."""
    return Relay(
        make_settings(NO_DATABASE, "unused:1", **settings),
        store=store,
        publisher=publisher,
        observers=observers,
    )
