"""The broker goes away while a relay process works: cut off, then stopped and started again.

The relay reaches the broker only through a TCP proxy (the broker advertises
the proxy's port). First the proxy drops every connection and refuses new
ones for 30 s (short: 5 s); then the broker process itself is stopped and a
new one started on the same port. The embedded broker keeps its data in
memory only (the bundled build has no other storage engine), so the new one
starts empty: the test reads everything the old one held before stopping it,
recreates the topic at once, and reads the new one from the beginning. The
relay recovers by itself each time, and its ``/readyz`` goes 503 and back to
200. What the relay's sends that timed out left on the old broker cannot be read
back from the new one: the relay runs with ``--on-unproven send``.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import sqlalchemy as sa

from tests.relay_support import TcpProxy, delivered_count, outbox_summary, scalar, wait_until
from tests.reliability.harness import (
    Collector,
    ReadinessWatch,
    RecoveryClock,
    RelayProcess,
    Writer,
    audit,
    check_writer,
    create_topic,
    wait_all_delivered,
)
from tests.reliability.report import seconds, size
from tests.reliability.servers import RestartableBroker


def test_broker_cut_off_and_restarted_loses_nothing_and_the_relay_recovers(
    engine: sa.Engine, database_url: str, tmp_path: Path
) -> None:
    outage = seconds(5, 30)
    downtime = seconds(3, 10)
    total = size(2_000, 30_000)
    rate = size(150, 500)
    keys = [f"key-{i:03d}" for i in range(size(50, 300))]
    topic = f"outage-{uuid.uuid4().hex[:10]}"
    partitions = 4

    proxy = TcpProxy(target_port=1)
    broker = RestartableBroker(tmp_path / "broker", advertised_port=proxy.port)
    proxy.set_target(broker.port)
    proxy.start()
    bootstrap = f"127.0.0.1:{proxy.port}"
    create_topic(bootstrap, topic, partitions)

    relay = RelayProcess(
        database_url,
        bootstrap,
        tmp_path,
        "relay",
        "--lease-seconds",
        "6",
        "--delivery-timeout-ms",
        "4000",
        "--batch-size",
        "200",
        # The restarted broker has lost everything: what the relay's timed-out sends
        # left on the old one cannot be read back, so nothing proves they are not
        # there. Told to send them anyway, the relay is at least once for them.
        "--on-unproven",
        "send",
    )
    ready = ReadinessWatch(relay)
    collector = Collector(bootstrap, topic)
    clock = RecoveryClock(engine)
    writer = Writer(engine, topic, keys, total, rate=rate)

    def explain() -> str:
        return f"{outbox_summary(engine)}\n--- relay log tail:\n{relay.log()[-4000:]}"

    def progress_after(count: int) -> None:
        wait_until(
            lambda: delivered_count(engine) > count,
            120,
            what="deliveries to resume",
            explain=explain,
        )

    try:
        relay.start()
        ready.start()
        wait_until(lambda: relay.get("/readyz")[0] == 200, 60, what="ready", explain=explain)
        writer.start()
        wait_until(lambda: delivered_count(engine) >= total // 5, 120, explain=explain)

        # 1. Cut off: every connection dropped, new ones accepted and closed at once.
        # The assertions are on what the watch saw: wait on the watch, not on a probe of
        # the test's own (readiness answers are cached; two clients can disagree a moment).
        mark = ready.wait_for(200, 10, explain)
        proxy.cut()
        cut_at = time.monotonic()
        ready.wait_for(503, 60, explain)
        time.sleep(max(0.0, outage - (time.monotonic() - cut_at)))
        assert relay.alive(), explain()
        during = delivered_count(engine)
        proxy.restore()
        clock.fault_ended()
        ready.wait_for(200, 120, explain)
        progress_after(during)
        assert ready.since(mark)[:3] == [200, 503, 200], ready.seen

        # 2. The broker process stopped and a new, empty one started on the same port.
        # The relay is paused only while the old broker is read to the end, so every
        # message it acknowledged is accounted for; then it runs with no broker at all.
        wait_until(lambda: delivered_count(engine) >= during + total // 10, 120)
        relay.freeze()
        with engine.connect() as conn:
            frozen = set(
                conn.execute(
                    sa.text("SELECT CAST(event_id AS text) FROM outbox WHERE status = 'delivered'")
                ).scalars()
            )
        collector.catch_up(frozen, 120)
        assert frozen <= collector.ids(), "the old broker lost acknowledged messages"
        mark = ready.wait_for(200, 10, explain)
        broker.stop()
        relay.thaw()
        ready.wait_for(503, 60, explain)
        time.sleep(downtime)
        stopped_at = delivered_count(engine)
        broker.start()
        # The new broker has no topics: recreate it, as an operator would.
        create_topic(bootstrap, topic, partitions)
        clock.fault_ended()
        collector.new_generation()
        ready.wait_for(200, 120, explain)
        progress_after(stopped_at)
        assert ready.since(mark)[:3] == [200, 503, 200], ready.seen

        writer.join(600)
        wait_all_delivered(engine, size(120, 600), explain)
        recover = clock.worst()
        collector.catch_up(set(writer.committed), 120)
        assert relay.alive(), explain()
    finally:
        writer.stop()
        ready.stop()
        code = relay.stop()
        collector.close()
        proxy.close()
        broker.close()
    assert code == 0, explain()
    check_writer(engine, writer)
    assert scalar(engine, "SELECT count(*) FROM outbox WHERE status = 'discarded'") == 0, explain()

    result = audit(engine, collector.generations)
    # What the old broker held of the relay's timed-out sends is sent again.
    result.assert_clean(duplicates=True)
    assert result.enqueued == total
    result.row(
        "broker outage",
        recover,
        f"cut off {outage:.0f} s through a proxy; broker restarted (empty, "
        f"{downtime:.0f} s down, topic recreated); /readyz 200→503→200 both times",
    )
