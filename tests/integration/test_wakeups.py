"""Wake-ups: a busy relay keeps reading its LISTEN connection, so the server's
notification queue (shared by every application of the cluster) never grows
behind it."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import sqlalchemy as sa

from outbox_kafka.naming import TableNames
from outbox_kafka.publisher import Delivery, Message, Publisher
from outbox_kafka.relay import Relay
from outbox_kafka.settings import RelaySettings
from tests.relay_support import (
    enqueue_bulk,
    make_settings,
    running_relay,
    scalar,
    seq_events,
    topic_outbox,
    wait_until,
)

#: PostgreSQL's notification queue holds at most this many 8 kB pages by default.
QUEUE_PAGES = 8 * 1024 * 1024 * 1024 // 8192


class _SlowPublisher(Publisher):
    """The real publisher, each send held for a moment: the relay stays busy."""

    def __init__(self, settings: RelaySettings) -> None:
        super().__init__(settings.producer_config(), settings.admin_config())

    def send(
        self,
        messages: Sequence[Message],
        *,
        timeout: float,
        abort: Callable[[], bool] | None = None,
    ) -> list[Delivery]:
        threading.Event().wait(0.25)
        return super().send(messages, timeout=timeout, abort=abort)


def _queue_pages(engine: sa.Engine) -> float:
    return float(scalar(engine, "SELECT pg_notification_queue_usage()")) * QUEUE_PAGES


def _notify(engine: sa.Engine, count: int) -> None:
    """``count`` notifications of about 7 kB each on the relay's channel, in one commit."""
    channel = TableNames().channel
    with engine.begin() as conn:
        conn.execute(
            sa.text("SELECT pg_notify(:c, n || repeat('x', 7000)) FROM generate_series(1, :n) n"),
            {"c": channel, "n": count},
        )


def test_a_busy_relay_reads_its_notifications_and_never_pins_the_server_queue(
    engine: sa.Engine, database_url: str, kafka_bootstrap: str, new_topic: Callable[..., str]
) -> None:
    topic = new_topic(partitions=2)
    settings = make_settings(database_url, kafka_bootstrap, batch_size=5, poll_interval=0.1)
    relay = Relay(settings, publisher=_SlowPublisher(settings))
    with running_relay(relay) as thread:
        # Idle first, so that it listens; then a backlog that keeps it busy (5 events
        # per quarter second) for longer than the test looks.
        threading.Event().wait(0.5)
        enqueue_bulk(engine, topic_outbox(), seq_events(topic, [f"k{i}" for i in range(200)], 200))
        wait_until(lambda: thread.cycles >= 2, 30, what="the relay busy")
        # About 10 MB of notifications: more than the connection's socket buffers
        # hold, so only a client that reads lets the server move past them.
        _notify(engine, 1500)
        threading.Event().wait(1.5)
        # The server frees queue pages when a notifying transaction crosses a few.
        _notify(engine, 10)
        threading.Event().wait(0.3)
        pages = _queue_pages(engine)
        busy = scalar(engine, "SELECT count(*) FROM outbox WHERE status = 'pending'")
    assert thread.error is None
    assert busy > 0, "the relay went idle: the test did not look while it was busy"
    assert pages < 100, f"{pages:.0f} pages of notifications held behind the busy relay"
