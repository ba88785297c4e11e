"""A real Prometheus scrapes a real relay: what it stores is what the relay delivered.

The relay runs as ``outbox-kafka relay --metrics-port P`` against the test
database and broker; Debian's ``prometheus`` server runs on loopback with the
shipped ``deploy/prometheus/prometheus.yml`` (its targets pointed at the relay)
and is asked through its HTTP API, as Grafana asks it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

import pytest
import sqlalchemy as sa
import yaml

from outbox_kafka.demo.embedded import free_port
from tests.relay_support import (
    delivered_count,
    enqueue_bulk,
    outbox_summary,
    seq_events,
    topic_outbox,
    wait_until,
)

REPO = Path(__file__).resolve().parent.parent.parent
CLI = str(Path(sys.executable).with_name("outbox-kafka"))
SHIPPED_CONFIG = REPO / "deploy" / "prometheus" / "prometheus.yml"
EVENTS = 120


def prometheus_binary() -> str:
    found = shutil.which("prometheus")
    if found is None:
        message = (
            "the prometheus server is missing (Debian package prometheus; .ci/run installs it)"
        )
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return found


def tail(path: Path, lines: int = 30) -> str:
    text = path.read_text(errors="replace") if path.exists() else ""
    return "\n".join(text.splitlines()[-lines:])


def stop_process(process: subprocess.Popen[bytes], timeout: float = 20.0) -> int:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)
    return process.returncode


def spawn(args: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    out: IO[bytes] = log.open("wb")
    try:
        return subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    finally:
        out.close()


@pytest.fixture
def relay_process(
    tmp_path: Path, database_url: str, kafka_bootstrap: str
) -> Iterator[tuple[int, Path]]:
    """A relay serving /metrics on a free loopback port; stopped (SIGTERM) afterwards."""
    port = free_port()
    log = tmp_path / "relay.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    env.update(
        {
            "OUTBOX_DATABASE_URL": database_url,
            "OUTBOX_KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap,
        }
    )
    process = spawn(
        [
            CLI,
            "relay",
            "--metrics-port",
            str(port),
            "--metrics-host",
            "127.0.0.1",
            "--lease-seconds",
            "5",
            "--delivery-timeout-ms",
            "3000",
            "--poll-interval",
            "0.1",
        ],
        log,
        env,
    )
    try:
        yield port, log
    finally:
        code = stop_process(process)
    assert code == 0, f"the relay exited {code}:\n{tail(log)}"


def prometheus_config(shipped: dict[str, Any], relay_port: int) -> tuple[dict[str, Any], str]:
    """The shipped config, scraping the test relay every second; and the relay's job name."""
    config = json.loads(json.dumps(shipped))
    config["global"]["scrape_interval"] = "1s"
    config["global"]["evaluation_interval"] = "1s"
    [job] = [j for j in config["scrape_configs"] if "relay" in j["job_name"]]
    job["scrape_interval"] = "1s"
    job["scrape_timeout"] = "1s"
    for group in job["static_configs"]:
        group["targets"] = [f"127.0.0.1:{relay_port}"]
    return config, str(job["job_name"])


@pytest.fixture
def start_prometheus(tmp_path: Path) -> Iterator[Callable[[int], tuple[str, str, Path]]]:
    """``start_prometheus(relay_port)`` -> (base URL, job name, log); killed afterwards."""
    binary = prometheus_binary()
    started: list[subprocess.Popen[bytes]] = []

    def start(relay_port: int) -> tuple[str, str, Path]:
        config, job = prometheus_config(yaml.safe_load(SHIPPED_CONFIG.read_text()), relay_port)
        config_path = tmp_path / "prometheus.yml"
        config_path.write_text(yaml.safe_dump(config))
        port = free_port()
        log = tmp_path / "prometheus.log"
        process = spawn(
            [
                binary,
                f"--config.file={config_path}",
                f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            log,
        )
        started.append(process)
        base = f"http://127.0.0.1:{port}"

        def ready() -> bool:
            assert process.poll() is None, f"prometheus exited:\n{tail(log)}"
            try:
                with urllib.request.urlopen(f"{base}/-/ready", timeout=2) as response:
                    return bool(response.status == 200)
            except OSError:
                return False

        wait_until(ready, 60, what="prometheus to be ready", explain=lambda: tail(log))
        return base, job, log

    yield start
    for process in started:
        if process.poll() is None:
            process.kill()
        process.wait(10)


def instant(base: str, query: str) -> list[dict[str, Any]]:
    """Run a PromQL instant query; the result vector."""
    url = f"{base}/api/v1/query?{urllib.parse.urlencode({'query': query})}"
    with urllib.request.urlopen(url, timeout=5) as response:
        body = json.load(response)
    assert body["status"] == "success", body
    assert body["data"]["resultType"] == "vector", body
    result: list[dict[str, Any]] = body["data"]["result"]
    return result


def test_prometheus_reads_the_number_of_published_events_from_the_relay(
    engine: sa.Engine,
    new_topic: Callable[..., str],
    start_prometheus: Callable[[int], tuple[str, str, Path]],
    relay_process: tuple[int, Path],
) -> None:
    relay_port, relay_log = relay_process
    topic = new_topic(3)
    enqueue_bulk(engine, topic_outbox(), seq_events(topic, [f"k{i}" for i in range(8)], EVENTS))
    wait_until(
        lambda: delivered_count(engine) == EVENTS,
        90,
        what=f"{EVENTS} events delivered",
        explain=lambda: f"{outbox_summary(engine)}\n{tail(relay_log)}",
    )
    base, job, prometheus_log = start_prometheus(relay_port)

    selector = f'outbox_events_published_total{{job="{job}",topic="{topic}"}}'
    seen: list[list[dict[str, Any]]] = []

    def scraped() -> bool:
        seen.append(instant(base, selector))
        return bool(seen[-1]) and float(seen[-1][0]["value"][1]) >= EVENTS

    wait_until(
        scraped,
        60,
        what="prometheus to store the relay's published counter",
        explain=lambda: f"last answer: {seen[-1:]}\n{tail(prometheus_log)}\n{tail(relay_log)}",
    )
    [series] = seen[-1]
    assert float(series["value"][1]) == EVENTS == delivered_count(engine)
    assert series["metric"]["instance"] == f"127.0.0.1:{relay_port}"

    [up] = instant(base, f'up{{job="{job}"}}')
    assert up["value"][1] == "1"
