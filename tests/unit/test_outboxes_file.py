"""The outboxes file of a multi-outbox relay: what it accepts, and each mistake named."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest

from outbox_kafka import ConfigurationError
from outbox_kafka.relay.outbox_metrics import outbox_labelled_registry
from outbox_kafka.relay.outboxes import load_outboxes, settings_for
from outbox_kafka.relay.settings import RelaySettings


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
