"""Two relay processes on one outbox; one is killed with SIGKILL again and again.

Writers commit events steadily over many keys while relay B is killed at
random moments and started again each time. Relay A keeps running; B's keys
pass to A (or to B's next incarnation) when their leases run out. Nothing may
be lost, reordered or sent twice: the relay that takes a killed relay's keys
over reads Kafka back before it sends them, and records what it finds there.
"""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import sqlalchemy as sa

from tests.relay_support import delivered_count, outbox_summary, wait_until
from tests.reliability.harness import (
    Collector,
    RecoveryClock,
    RelayProcess,
    Writer,
    audit,
    check_writer,
    wait_all_delivered,
)
from tests.reliability.report import size

LEASE = ("--lease-seconds", "4", "--delivery-timeout-ms", "2000", "--batch-size", "200")


def test_relay_killed_ten_times_loses_and_reorders_nothing(
    engine: sa.Engine,
    database_url: str,
    kafka_bootstrap: str,
    new_topic: Callable[..., str],
    tmp_path: Path,
) -> None:
    total = size(4_000, 50_000)
    keys = [f"key-{i:03d}" for i in range(size(100, 500))]
    kills = size(3, 10)
    rate = size(400, 900)
    rng = random.Random(uuid.uuid4().int)
    topic = new_topic(6)

    steady = RelayProcess(database_url, kafka_bootstrap, tmp_path, "relay-a", *LEASE)
    victim = RelayProcess(database_url, kafka_bootstrap, tmp_path, "relay-b", *LEASE)
    collector = Collector(kafka_bootstrap, topic)
    clock = RecoveryClock(engine)
    writer = Writer(engine, topic, keys, total, rate=rate, chunk=size(10, 25))

    def explain() -> str:
        return f"{outbox_summary(engine)}\n--- relay b log tail:\n{victim.log()[-3000:]}"

    try:
        steady.start()
        victim.start()
        writer.start()
        # Kill moments spread over the writing period (and a little after it).
        window = total / rate
        moments = sorted(rng.uniform(0.1, 1.0) * window for _ in range(kills))
        started = time.monotonic()
        for n, moment in enumerate(moments, start=1):
            # Wait for the moment, and for relay B to be working (holding keys) by then.
            while time.monotonic() - started < moment:
                collector.read(0.2)
            wait_until(
                lambda: victim.get("/healthz")[0] == 200,
                60,
                what=f"relay b healthy before kill {n}",
                explain=explain,
            )
            victim.kill()
            clock.fault_ended()
            victim.start()
        writer.join(300)
        wait_all_delivered(engine, size(120, 600), explain)
        recover = clock.worst()
        collector.catch_up(set(writer.committed), 120)
    finally:
        writer.stop()
        codes = (steady.stop(), victim.stop())
        collector.close()
    assert codes == (0, 0), explain()
    assert victim.starts == kills + 1
    check_writer(engine, writer)

    result = audit(engine, collector.generations)
    result.assert_clean()
    assert result.enqueued == total == delivered_count(engine)
    result.row(
        "relay crashes",
        recover,
        f"2 relays, {len(keys)} keys, {kills} SIGKILLs; no duplicate",
    )
