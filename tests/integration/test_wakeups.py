"""Wake-ups: a busy relay keeps reading its LISTEN connection, so the server's
notification queue (shared by every application of the cluster) never grows
behind it."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import sqlalchemy as sa

from outbox_kafka.naming import TableNames
from outbox_kafka.relay import Relay
from outbox_kafka.relay.config import RelaySettings
from outbox_kafka.relay.ports import Delivery, Message
from outbox_kafka.relay.send import Publisher
from outbox_kafka.relay.store import Store
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
        # per quarter second) far longer than the test looks.
        threading.Event().wait(0.5)
        enqueue_bulk(engine, topic_outbox(), seq_events(topic, [f"k{i}" for i in range(200)], 2000))
        wait_until(lambda: thread.cycles >= 2, 30, what="the relay busy")
        # About 10 MB of notifications (sent by other applications, or while the relay
        # was idle): more than the connection's socket buffers hold, so only a client
        # that reads lets the server move past them.
        _notify(engine, 1500)
        held = _queue_pages(engine)

        def freed() -> bool:
            # The server frees queue pages when a notifying transaction crosses a few.
            _notify(engine, 10)
            return _queue_pages(engine) < 100

        wait_until(
            freed,
            60,
            interval=0.5,
            what="the notification queue freed while the relay is busy",
            explain=lambda: f"{_queue_pages(engine):.0f} pages held",
        )
        busy = scalar(engine, "SELECT count(*) FROM outbox WHERE status = 'pending'")
    assert thread.error is None
    assert held >= 1000, f"only {held:.0f} pages were used: the test measured nothing"
    assert busy > 0, "the relay went idle: the test did not look while it was busy"


def test_a_relay_going_idle_waits_for_writers_that_did_not_notify(
    engine: sa.Engine, database_url: str
) -> None:
    """An enqueue committed while no relay was idle sends no notify; the relay about to
    wait idle takes the wake lock only once such a writer has committed, so its last
    look for work sees the writer's event."""
    outbox = topic_outbox()
    store = Store(database_url, TableNames())
    wakeups = store.wakeups()
    try:
        with engine.connect() as writer:
            outbox.enqueue(writer, type="t", key="a", data=0, topic="t")
            # The writer holds the wake lock shared until it ends.
            assert wakeups.announce_idle(0.2) is False
            assert not wakeups.idle_announced
            announcing = ThreadPoolExecutor(1).submit(wakeups.announce_idle, 30)
            wait_until(
                lambda: (
                    scalar(
                        engine,
                        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                        "AND query LIKE '%pg_advisory_lock(%'",
                    )
                    == 1
                ),
                10,
                what="the relay waiting for the writer",
            )
            writer.commit()
        assert announcing.result(10) is True
        assert wakeups.idle_announced
        # The writer's event is there for the relay's last look.
        assert len(store.claim(batch_size=10, lease_seconds=1).keys) == 1

        # While the relay waits idle, a commit notifies it; once it is busy, none does.
        with engine.begin() as conn:
            outbox.enqueue(conn, type="t", key="b", data=0, topic="t")
        assert wakeups.wait_for_wakeup(10) is True
        wakeups.announce_busy()
        with engine.begin() as conn:
            outbox.enqueue(conn, type="t", key="c", data=0, topic="t")
        assert wakeups.wait_for_wakeup(0.5) is False
    finally:
        wakeups.close()
        store.close()


def test_one_relay_holds_the_wake_lock_and_the_others_hear_its_wake_ups(
    engine: sa.Engine, database_url: str
) -> None:
    stores = [Store(database_url, TableNames()) for _ in range(2)]
    first, second = (store.wakeups() for store in stores)
    try:
        assert first.announce_idle(1) is True
        assert second.announce_idle(0.1) is False
        assert second.another_relay_idle() is True
        with engine.begin() as conn:
            topic_outbox().enqueue(conn, type="t", key="a", data=0, topic="t")
        assert second.wait_for_wakeup(10) is True
        assert first.wait_for_wakeup(10) is True
        first.announce_busy()
        assert second.another_relay_idle() is False
        assert second.announce_idle(1) is True
    finally:
        for closing in (first, second, *stores):
            closing.close()


def test_an_idle_relay_wakes_on_a_commit_long_before_its_poll_interval(
    engine: sa.Engine, database_url: str, kafka_bootstrap: str, new_topic: Callable[..., str]
) -> None:
    topic = new_topic(partitions=2)
    relays = [
        Relay(make_settings(database_url, kafka_bootstrap, poll_interval=60.0)) for _ in range(2)
    ]
    with running_relay(relays[0], "a"), running_relay(relays[1], "b"):
        for round_ in range(5):
            # Idle again: the relays have taken the last event and looked once more.
            threading.Event().wait(0.5)
            with engine.begin() as conn:
                topic_outbox().enqueue(conn, type="t", key=f"k{round_}", data=0, topic=topic)
            wait_until(
                lambda: scalar(engine, "SELECT count(*) FROM outbox WHERE status = 'pending'") == 0,
                10,
                interval=0.05,
                what=f"round {round_}'s event delivered (poll interval 60 s)",
            )
