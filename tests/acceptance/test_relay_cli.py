"""``outbox-kafka relay`` as an operator runs it: flags, environment, exit codes."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

import pytest
import sqlalchemy as sa

from outbox_kafka import ConfigurationError, Outbox
from outbox_kafka.limits import (
    DEFAULT_MAX_KEY_BYTES,
    DEFAULT_MAX_MESSAGE_BYTES,
    KAFKA_MESSAGE_MAX_BYTES,
    enqueue_limit_for,
)
from outbox_kafka.naming import TableNames
from outbox_kafka.relay.config import RelaySettings
from outbox_kafka.relay.store import Store
from tests.relay_support import (
    consume_all,
    enqueue_bulk,
    per_key_order,
    scalar,
    seq_events,
    topic_outbox,
)

REPO = Path(__file__).resolve().parent.parent.parent
CLI = str(Path(sys.executable).with_name("outbox-kafka"))


def run_cli(
    *args: str, env: Mapping[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    base["COLUMNS"] = "200"
    base.update(env or {})
    return subprocess.run(
        [CLI, *args],
        capture_output=True,
        text=True,
        env=base,
        timeout=timeout,
        cwd=REPO,
        check=False,
    )


# --------------------------------------------------------------------------- settings checks


@pytest.mark.parametrize(
    ("lease", "timeout_ms", "kafka"),
    [
        (5.0, 4001, {}),
        (30.0, 10_000, {"delivery.timeout.ms": "24001"}),
        (30.0, 10_000, {"message.timeout.ms": "30000"}),
    ],
)
def test_delivery_timeout_over_80_percent_of_the_lease_is_refused(
    lease: float, timeout_ms: int, kafka: dict[str, str]
) -> None:
    with pytest.raises(ConfigurationError) as caught:
        RelaySettings(
            database_url="postgresql://u@h/d",
            bootstrap_servers="h:9092",
            lease_seconds=lease,
            delivery_timeout_ms=timeout_ms,
            kafka_config=kafka,
        )
    message = str(caught.value)
    assert "delivery timeout" in message
    assert "80%" in message
    assert f"{lease * 1000:.0f} ms" in message
    assert "--lease-seconds" in message


def test_delivery_timeout_of_exactly_80_percent_is_accepted() -> None:
    settings = RelaySettings(
        database_url="postgresql://u@h/d",
        bootstrap_servers="h:9092",
        lease_seconds=5.0,
        delivery_timeout_ms=4000,
    )
    assert settings.producer_config()["delivery.timeout.ms"] == "4000"
    assert settings.producer_config()["enable.idempotence"] == "true"
    assert settings.producer_config()["acks"] == "all"


@pytest.mark.parametrize("partitioner", ["random", "consistent_random", "fnv1a_random"])
def test_a_partitioner_other_than_murmur2_is_refused(partitioner: str) -> None:
    """Any other partitioner would send a key's events to another partition than
    Java clients do (or, for random, to several)."""
    with pytest.raises(ConfigurationError) as caught:
        RelaySettings(
            database_url="postgresql://u@h/d",
            bootstrap_servers="h:9092",
            kafka_config={"partitioner": partitioner},
        )
    assert f"partitioner={partitioner} is not allowed" in str(caught.value)
    assert "murmur2_random" in str(caught.value)


def test_murmur2_partitioners_are_accepted_and_the_default_is_murmur2_random() -> None:
    default = RelaySettings(database_url="postgresql://u@h/d", bootstrap_servers="h:9092")
    assert default.producer_config()["partitioner"] == "murmur2_random"
    plain = RelaySettings(
        database_url="postgresql://u@h/d",
        bootstrap_servers="h:9092",
        kafka_config={"partitioner": "murmur2"},
    )
    assert plain.producer_config()["partitioner"] == "murmur2"


def test_the_relays_message_size_limit_is_above_what_enqueue_accepts_by_default() -> None:
    """One limit: enqueue's default leaves the record framing below the relay's
    message.max.bytes, so an event enqueue accepts is never too large to send."""
    config = RelaySettings(
        database_url="postgresql://u@h/d", bootstrap_servers="h:9092"
    ).producer_config()
    assert int(config["message.max.bytes"]) == KAFKA_MESSAGE_MAX_BYTES
    assert enqueue_limit_for(KAFKA_MESSAGE_MAX_BYTES) == DEFAULT_MAX_MESSAGE_BYTES
    # A small limit leaves producers half of it, never a negative size.
    assert (enqueue_limit_for(16384), enqueue_limit_for(1000)) == (8192, 500)
    assert Outbox(allow_unknown_types=True).limits == (
        DEFAULT_MAX_KEY_BYTES,
        DEFAULT_MAX_MESSAGE_BYTES,
    )


@pytest.mark.parametrize(
    ("value", "problem"), [("lots", "is not an integer"), ("999", "is too small")]
)
def test_a_message_max_bytes_that_cannot_work_is_refused(value: str, problem: str) -> None:
    with pytest.raises(ConfigurationError) as caught:
        RelaySettings(
            database_url="postgresql://u@h/d",
            bootstrap_servers="h:9092",
            kafka_config={"message.max.bytes": value},
        )
    assert "Kafka setting message.max.bytes=" in str(caught.value)
    assert problem in str(caught.value)


def test_cli_refuses_a_random_partitioner() -> None:
    result = run_cli(
        "relay",
        "--database-url",
        "postgresql://nobody@127.0.0.1:1/nothing",
        "--bootstrap-servers",
        "127.0.0.1:1",
        "--kafka-config",
        "partitioner=random",
    )
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    assert "partitioner=random is not allowed" in result.stderr


def test_cli_refuses_a_delivery_timeout_longer_than_the_lease_allows() -> None:
    result = run_cli(
        "relay",
        "--database-url",
        "postgresql://nobody@127.0.0.1:1/nothing",
        "--bootstrap-servers",
        "127.0.0.1:1",
        "--lease-seconds",
        "5",
        "--delivery-timeout-ms",
        "4500",
    )
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    assert "outbox-kafka relay: error:" in result.stderr
    assert "delivery timeout (4500 ms) must be at most 80% of the lease" in result.stderr


def test_cli_refuses_it_from_the_environment_too() -> None:
    result = run_cli(
        "relay",
        env={
            "OUTBOX_DATABASE_URL": "postgresql://nobody@127.0.0.1:1/nothing",
            "OUTBOX_KAFKA_BOOTSTRAP_SERVERS": "127.0.0.1:1",
            "OUTBOX_LEASE_SECONDS": "2",
            "OUTBOX_DELIVERY_TIMEOUT_MS": "1601",
        },
    )
    assert result.returncode != 0
    assert "must be at most 80% of the lease" in result.stderr


def test_cli_without_a_database_url_says_so() -> None:
    result = run_cli("relay", "--bootstrap-servers", "127.0.0.1:1")
    assert result.returncode != 0
    assert "OUTBOX_DATABASE_URL" in result.stderr
    assert "Traceback" not in result.stderr


def test_relay_help_names_every_environment_variable() -> None:
    result = run_cli("relay", "--help")
    assert result.returncode == 0
    for variable in (
        "OUTBOX_DATABASE_URL",
        "OUTBOX_KAFKA_BOOTSTRAP_SERVERS",
        "OUTBOX_BATCH_SIZE",
        "OUTBOX_LEASE_SECONDS",
        "OUTBOX_DELIVERY_TIMEOUT_MS",
        "OUTBOX_POLL_INTERVAL",
        "OUTBOX_MAX_ATTEMPTS",
        "OUTBOX_DEAD_LETTER_TOPIC",
        "OUTBOX_ON_EXHAUSTED",
        "OUTBOX_CREATE_TOPICS",
        "OUTBOX_SHUTDOWN_TIMEOUT",
        "OUTBOX_DRAIN",
        "OUTBOX_KAFKA_CONFIG_",
    ):
        assert variable in result.stdout, variable
    for flag in ("--drain", "--dead-letter-topic", "--on-exhausted", "--create-topics"):
        assert flag in result.stdout


# --------------------------------------------------------------------------- --drain end to end


def test_drain_through_the_cli_publishes_everything_and_exits_zero(
    engine: sa.Engine, database_url: str, kafka_bootstrap: str, new_topic: Callable[..., str]
) -> None:
    topic = new_topic(3)
    events = seq_events(topic, [f"k{i}" for i in range(7)], 300)
    ids = enqueue_bulk(engine, topic_outbox(), events)

    result = run_cli(
        "relay",
        "--drain",
        "--batch-size",
        "50",
        "--lease-seconds",
        "5",
        "--delivery-timeout-ms",
        "3000",
        env={
            "OUTBOX_DATABASE_URL": database_url,
            "OUTBOX_KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap,
        },
    )
    assert result.returncode == 0, result.stderr
    assert "drained: 300 delivered, 0 discarded" in result.stdout
    assert scalar(engine, "SELECT count(*) FROM outbox WHERE status <> 'delivered'") == 0
    assert scalar(engine, "SELECT count(*) FROM outbox_keys") == 0

    records = consume_all(kafka_bootstrap, topic, 300)
    assert sorted(r.event_id for r in records) == sorted(ids)
    expected: dict[str, list[str]] = {}
    for event, event_id in zip(events, ids, strict=True):
        expected.setdefault(event.key, []).append(event_id)
    assert per_key_order(records) == expected


def test_drain_waits_for_the_leases_of_a_killed_relay_and_says_what_is_left(
    engine: sa.Engine, database_url: str, kafka_bootstrap: str, new_topic: Callable[..., str]
) -> None:
    """Found: after a relay was killed, --drain exited 0 at once with the dead relay's
    keys still leased and their events pending."""
    topic = new_topic(2)
    ids = enqueue_bulk(engine, topic_outbox(), seq_events(topic, [f"k{i}" for i in range(6)], 60))
    env = {"OUTBOX_DATABASE_URL": database_url, "OUTBOX_KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap}
    timing = ["--lease-seconds", "5", "--delivery-timeout-ms", "3000"]

    dead = Store(database_url, TableNames())  # a relay killed between claim and record
    try:
        held = dead.claim(batch_size=30, lease_seconds=20.0, max_keys=3)
    finally:
        dead.close()
    assert len(held.keys) == 3

    short = run_cli("relay", "--drain", "--drain-timeout", "1", *timing, env=env)
    assert short.returncode == 3, short.stdout + short.stderr
    assert "left pending: 30 (30 on keys another relay still holds a lease on)" in short.stdout

    with engine.begin() as conn:  # the dead relay's leases end
        conn.execute(
            sa.text(
                "UPDATE outbox_keys SET lease_expires_at = now() + interval '2 s', "
                "due_at = now() + interval '2 s' WHERE claim_token IS NOT NULL"
            )
        )
    result = run_cli("relay", "--drain", "--drain-timeout", "30", *timing, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "drained: 30 delivered" in result.stdout and "nothing left pending" in result.stdout
    assert scalar(engine, "SELECT count(*) FROM outbox WHERE status <> 'delivered'") == 0
    records = consume_all(kafka_bootstrap, topic, 60)
    assert sorted(r.event_id for r in records) == sorted(ids)


def test_drain_with_a_dead_letter_topic_flag_copies_the_discarded_event(
    engine: sa.Engine, database_url: str, kafka_bootstrap: str, new_topic: Callable[..., str]
) -> None:
    topic = new_topic(2)
    dlt = new_topic(1, prefix="dlt")
    ids = enqueue_bulk(engine, topic_outbox(), seq_events(topic, ["a", "b"], 6))
    with engine.begin() as conn:
        conn.execute(
            sa.text("UPDATE outbox SET value = 'not json'::bytea WHERE event_id = :id"),
            {"id": ids[2]},
        )

    result = run_cli(
        "relay",
        "--drain",
        "--database-url",
        database_url,
        "--bootstrap-servers",
        kafka_bootstrap,
        "--dead-letter-topic",
        dlt,
        "--lease-seconds",
        "5",
        "--delivery-timeout-ms",
        "3000",
    )
    assert result.returncode == 0, result.stderr
    assert "drained: 5 delivered, 1 discarded" in result.stdout

    [copy] = consume_all(kafka_bootstrap, dlt, 1)
    assert copy.headers["outbox_event_id"] == ids[2].encode()
    assert copy.raw == b"not json"
    assert b"not JSON" in copy.headers["outbox_error"]
    records = consume_all(kafka_bootstrap, topic, 5)
    assert per_key_order(records) == {"a": [ids[0], ids[4]], "b": [ids[1], ids[3], ids[5]]}
