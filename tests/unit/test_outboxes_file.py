"""The outboxes file of a multi-outbox relay: what it accepts, and each mistake named."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest

from outbox_kafka import ConfigurationError
from outbox_kafka.relay.config import RelaySettings
from outbox_kafka.relay.group import load_outboxes, outbox_labelled_registry, settings_for


def load(tmp_path: Path, text: str, *, database_url: str | None = "postgresql://h/app") -> list:
    file = tmp_path / "outboxes.toml"
    file.write_text(text, encoding="utf-8")
    return load_outboxes(file, database_url=database_url, table="outbox", db_schema="public")


def test_entries_take_their_own_database_schema_and_table_or_the_defaults(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BILLING_URL", "postgresql://billing/db")
    targets = load(
        tmp_path,
        "[outboxes.orders]\n"
        '[outboxes.billing]\ndatabase_url_env = "BILLING_URL"\ntable = "events"\n'
        '[outboxes.tenant-a]\nschema = "tenant_a"\n',
    )
    assert [(t.name, t.database_url, t.db_schema, t.table) for t in targets] == [
        ("orders", "postgresql://h/app", "public", "outbox"),
        ("billing", "postgresql://billing/db", "public", "events"),
        ("tenant-a", "postgresql://h/app", "tenant_a", "outbox"),
    ]
    shared = RelaySettings(database_url="postgresql://h/app", bootstrap_servers="k:9092")
    own = settings_for(shared, targets[1])
    assert (own.database_url, own.table, own.relay_id) == (
        "postgresql://billing/db",
        "events",
        f"{shared.relay_id}/billing",
    )
    assert own.lease_seconds == shared.lease_seconds


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[outboxes.orders]\ntabel = 'x'\n", "outbox 'orders': unknown key(s) ['tabel']"),
        ("[outboxes.Orders]\n", "outbox name 'Orders'"),
        ("[outboxes.orders]\nschema = 'Bad-Name'\n", "outbox 'orders': "),
        ("[outboxes.orders]\ntable = 3\n", "outbox 'orders': table must be a non-empty string"),
        (
            "[outboxes.orders]\ndatabase_url_env = 'NOT_SET_ANYWHERE_1'\n",
            "the variable NOT_SET_ANYWHERE_1 (its database_url_env) is not set",
        ),
        (
            "[outboxes.orders]\ndatabase_url = 'postgresql://a/b'\ndatabase_url_env = 'X'\n",
            "give database_url or database_url_env, not both",
        ),
        ("[outboxes.a]\n[outboxes.b]\n", "outboxes 'a' and 'b' are the same table"),
        ("[outbox.orders]\n", "must hold [outboxes.<name>] tables"),
        ("[outboxes]\n", "must hold [outboxes.<name>] tables"),
        ("outboxes = [", "is not TOML"),
    ],
)
def test_a_mistake_in_the_file_is_refused_naming_it(
    tmp_path: Path, text: str, message: str
) -> None:
    with pytest.raises(ConfigurationError) as caught:
        load(tmp_path, text)
    assert message in str(caught.value)


def test_an_entry_without_any_database_url_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="outbox 'orders' has no database URL"):
        load(tmp_path, "[outboxes.orders]\n", database_url=None)


def test_a_missing_file_is_refused_naming_it(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="cannot read the outboxes file"):
        load_outboxes(tmp_path / "nope.toml", database_url=None, table="outbox", db_schema="p")


def test_each_outbox_metrics_are_served_once_per_family_with_an_outbox_label() -> None:
    registries = {"a": CollectorRegistry(), "b": CollectorRegistry()}
    counters = {
        name: Counter("outbox_events_published", "Events.", ["topic"], registry=registry)
        for name, registry in registries.items()
    }
    counters["a"].labels(topic="t").inc(3)
    counters["b"].labels(topic="t").inc(5)
    text = generate_latest(outbox_labelled_registry(registries)).decode()
    assert text.count("# TYPE outbox_events_published_total counter") == 1
    assert 'outbox_events_published_total{outbox="a",topic="t"} 3.0' in text
    assert 'outbox_events_published_total{outbox="b",topic="t"} 5.0' in text


# --------------------------------------------------------------------------- settings per outbox

SHARED = RelaySettings(database_url="postgresql://h/app", bootstrap_servers="k:9092")


def test_an_entry_sets_its_own_loop_and_takes_the_options_for_the_rest(tmp_path: Path) -> None:
    targets = load(
        tmp_path,
        "[outboxes.orders]\n"
        "[outboxes.bulk]\nschema = 'bulk'\n"
        "batch_size = 5000\nmax_claim_bytes = 1048576\nlease_seconds = 60\n"
        "max_attempts = 3\non_exhausted = 'park'\nbackoff_base = 1\nbackoff_cap = 120.5\n"
        "dead_letter_topic = 'bulk.dead'\nretain_delivered_days = 1.5\n"
        "retain_discarded_days = 30\nlisten = false\npoll_interval = 2\n"
        "purge_interval = 60\nsample_interval = 30\n",
    )
    orders, bulk = (settings_for(SHARED, t) for t in targets)
    assert (orders.batch_size, orders.lease_seconds, orders.max_attempts) == (
        SHARED.batch_size,
        SHARED.lease_seconds,
        SHARED.max_attempts,
    )
    assert (bulk.batch_size, bulk.max_claim_bytes, bulk.lease_seconds) == (5000, 1048576, 60.0)
    assert (bulk.max_attempts, bulk.on_exhausted, bulk.dead_letter_topic) == (
        3,
        "park",
        "bulk.dead",
    )
    assert (bulk.backoff_base, bulk.backoff_cap) == (1.0, 120.5)
    assert (bulk.retain_delivered_seconds, bulk.retain_discarded_seconds) == (
        1.5 * 86400,
        30 * 86400,
    )
    assert (bulk.listen, bulk.poll_interval, bulk.purge_interval, bulk.sample_interval) == (
        False,
        2.0,
        60.0,
        30.0,
    )
    # What the producer is made of stays the shared settings'.
    assert bulk.producer_config() == SHARED.producer_config() | {
        "queue.buffering.max.messages": "100000"
    }


def test_an_empty_dead_letter_topic_turns_the_shared_one_off_for_that_outbox(
    tmp_path: Path,
) -> None:
    shared = RelaySettings(
        database_url="postgresql://h/app", bootstrap_servers="k:9092", dead_letter_topic="dead"
    )
    (target,) = load(tmp_path, "[outboxes.orders]\ndead_letter_topic = ''\n")
    assert settings_for(shared, target).dead_letter_topic is None


@pytest.mark.parametrize(
    ("entry", "as_options"),
    [
        ("batch_size = 0", {"batch_size": 0}),
        ("max_claim_bytes = -1", {"max_claim_bytes": -1}),
        ("lease_seconds = 0", {"lease_seconds": 0.0}),
        # The shared delivery timeout (10 s) must be at most 80% of this outbox's lease.
        ("lease_seconds = 12", {"lease_seconds": 12.0}),
        ("max_attempts = 0", {"max_attempts": 0}),
        ("backoff_base = 0", {"backoff_base": 0.0}),
        ("backoff_cap = 0.1", {"backoff_cap": 0.1}),
        ("on_exhausted = 'drop'", {"on_exhausted": "drop"}),
        ("dead_letter_topic = 'no spaces'", {"dead_letter_topic": "no spaces"}),
        ("poll_interval = 0", {"poll_interval": 0.0}),
    ],
)
def test_an_entry_setting_is_refused_as_its_option_would_be(
    tmp_path: Path, entry: str, as_options: dict[str, object]
) -> None:
    with pytest.raises(ConfigurationError) as by_options:
        RelaySettings(database_url="postgresql://h/app", bootstrap_servers="k:9092", **as_options)
    (target,) = load(tmp_path, f"[outboxes.orders]\n{entry}\n")
    with pytest.raises(ConfigurationError) as by_file:
        settings_for(SHARED, target)
    assert str(by_file.value) == f"outbox 'orders': {by_options.value}"


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ("batch_size = '10'", "batch_size must be an integer (as --batch-size), not '10'"),
        ("batch_size = 2.5", "batch_size must be an integer (as --batch-size), not 2.5"),
        ("max_attempts = true", "max_attempts must be an integer (as --max-attempts), not True"),
        ("lease_seconds = '30'", "lease_seconds must be a number (as --lease-seconds), not '30'"),
        ("listen = 'no'", "listen must be true or false (as --no-listen), not 'no'"),
        ("on_exhausted = 1", "on_exhausted must be a string (as --on-exhausted), not 1"),
        (
            "delivery_timeout_ms = 5000",
            "delivery_timeout_ms cannot be set per outbox: it belongs to the one Kafka "
            "producer every outbox shares (each outbox's lease_seconds must leave room for "
            "it); set --delivery-timeout-ms for every outbox",
        ),
        ("compression = 'zstd'", "set --compression for every outbox"),
        ("kafka_config = {}", "set --kafka-config for every outbox"),
        ("create_topics = 3", "creates each missing topic once for all outboxes"),
        ("shutdown_timeout = 5", "it belongs to the relay process, not to one outbox"),
        ("batch-size = 5", "(keys are spelt with '_': batch_size)"),
    ],
)
def test_an_entry_setting_of_the_wrong_kind_or_of_the_producer_is_refused_naming_it(
    tmp_path: Path, entry: str, message: str
) -> None:
    with pytest.raises(ConfigurationError) as caught:
        load(tmp_path, f"[outboxes.orders]\n{entry}\n")
    assert str(caught.value).startswith("outbox 'orders': "), caught.value
    assert message in str(caught.value)
