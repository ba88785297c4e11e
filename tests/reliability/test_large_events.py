"""A backlog of large events drains within the memory limit of the relay's pod.

The relay reads at most ``--max-claim-bytes`` of values and headers per claim
(32 MiB by default), so what it holds does not grow with the events' size
times the batch size. Before the budget, a claim of 1,000 events of 900 kB
needed about 1.8 GB. The test runs ``outbox-kafka relay --drain`` as a
process with its defaults and reads its peak RSS from the kernel.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import sqlalchemy as sa

from outbox_kafka import Event
from tests.relay_support import delivered_count, topic_outbox
from tests.reliability.report import size

MANIFEST = Path(__file__).resolve().parents[2] / "deploy" / "k8s" / "deployment.yaml"
EVENT_BYTES = 900_000
#: Runs the command given after it and prints its peak RSS in KiB (Linux: ru_maxrss).
PEAK_RSS = (
    "import resource, subprocess, sys\n"
    "code = subprocess.run(sys.argv[1:]).returncode\n"
    "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
    "sys.exit(code)\n"
)


def manifest_memory_limit() -> int:
    """The relay container's memory limit in deploy/k8s/deployment.yaml, in bytes."""
    text = MANIFEST.read_text(encoding="utf-8")
    limits = text[text.index("limits:") :]
    found = re.search(r"memory:\s*(\d+)Mi", limits)
    assert found, "no memory limit in Mi in the manifest's limits"
    return int(found.group(1)) * 1024 * 1024


def test_a_backlog_of_large_events_drains_within_the_pods_memory_limit(
    engine: sa.Engine,
    database_url: str,
    kafka_bootstrap: str,
    new_topic: Callable[..., str],
) -> None:
    count = size(300, 2_000)
    topic = new_topic(4)
    outbox = topic_outbox()
    pad = "x" * EVENT_BYTES
    for start in range(0, count, 20):
        with engine.begin() as conn:
            outbox.enqueue_many(
                conn,
                [
                    Event(type="t.big", key=f"k{i % 50}", data={"i": i, "pad": pad}, topic=topic)
                    for i in range(start, min(count, start + 20))
                ],
            )
    relay = [
        sys.executable,
        "-m",
        "outbox_kafka.cli",
        "relay",
        "--drain",
        "--database-url",
        database_url,
        "--bootstrap-servers",
        kafka_bootstrap,
        "--log-level",
        "WARNING",
    ]
    run = subprocess.run(
        [sys.executable, "-c", PEAK_RSS, *relay],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    peak = int(run.stdout.strip().splitlines()[-1]) * 1024
    limit = manifest_memory_limit()
    print(
        f"\n{count} events of {EVENT_BYTES:,} bytes drained; relay peak RSS "
        f"{peak / 2**20:.0f} MiB, the pod's limit {limit / 2**20:.0f} MiB"
    )
    assert delivered_count(engine) == count
    assert peak < limit, f"peak RSS {peak / 2**20:.0f} MiB over the {limit / 2**20:.0f} MiB limit"
