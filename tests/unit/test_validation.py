"""Routing, event-type policy, the named SQL statements and identifier checks (no database)."""

from __future__ import annotations

import re
from importlib import resources
from pathlib import Path

import pytest

from outbox_kafka import (
    ConfigurationError,
    DataSchemaViolation,
    Event,
    InvalidIdentifier,
    MissingTopic,
    Outbox,
    Route,
    SchemaError,
    TableNames,
    UnknownEventType,
)
from outbox_kafka.schema.statements import queries_for, raw_migrations, raw_queries, render
from tests.support import EVENT_SCHEMAS, ORDER_CREATED

PLACEHOLDER = re.compile(r"\{(\w+)\}")

# --- routing ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "routes",
    [
        {"order.*": "orders", "order.paid": "payments"},
        {"order.paid": "payments", "order.*": "orders"},
        [Route("order.*", "orders"), Route("order.paid", "payments")],
    ],
    ids=["glob-first", "exact-first", "route-objects"],
)
def test_exact_rule_beats_glob(routes: dict[str, str] | list[Route]) -> None:
    box = Outbox(routes=routes)
    assert box.topic_for("order.paid") == "payments"
    assert box.topic_for("order.created") == "orders"
    assert box.encode(Event(type="order.paid", key="k", data={})).topic == "payments"
    assert box.encode(Event(type="order.created", key="k", data={})).topic == "orders"


def test_glob_matches() -> None:
    box = Outbox(routes={"order.*": "orders", "user.?": "users", "*.audit": "audit"})
    assert box.topic_for("order.created") == "orders"
    assert box.topic_for("order.") == "orders"
    assert box.topic_for("user.x") == "users"
    assert box.topic_for("user.xy") is None
    assert box.topic_for("login.audit") == "audit"
    assert box.topic_for("orders") is None
    # Matching is case-sensitive.
    assert box.topic_for("Order.created") is None


def test_first_matching_glob_wins() -> None:
    box = Outbox(routes={"order.*": "orders", "*": "everything"})
    assert box.topic_for("order.created") == "orders"
    assert box.topic_for("invoice.created") == "everything"


def test_explicit_topic_beats_routing(outbox: Outbox) -> None:
    encoded = outbox.encode(
        Event(type="order.created", key="k", data=ORDER_CREATED, topic="special")
    )
    assert encoded.topic == "special"


def test_no_rule_and_no_topic_is_missing_topic() -> None:
    box = Outbox(routes={"order.*": "orders"})
    with pytest.raises(MissingTopic) as excinfo:
        box.encode(Event(type="invoice.created", key="k", data={}))
    assert excinfo.value.field == "topic"
    assert "invoice.created" in str(excinfo.value)
    with pytest.raises(MissingTopic):
        Outbox().encode(Event(type="order.created", key="k", data={}))
    # With a topic it is fine.
    assert Outbox().encode(Event(type="x", key="k", data={}, topic="t")).topic == "t"


@pytest.mark.parametrize(
    "routes",
    [{"order.*": "bad topic"}, {"": "orders"}, {"order.*": ""}, {"order.*": "a" * 250}],
)
def test_bad_routing_rules_are_configuration_errors(routes: dict[str, str]) -> None:
    with pytest.raises(ConfigurationError):
        Outbox(routes=routes)


# --- event types and schemas -------------------------------------------------------------


def test_unknown_type_rejected_with_schema_dir(outbox: Outbox) -> None:
    with pytest.raises(UnknownEventType) as excinfo:
        outbox.encode(Event(type="order.refunded", key="k", data={}))
    assert excinfo.value.field == "type"
    assert "order.refunded" in str(excinfo.value)


def test_unknown_type_allowed_when_asked() -> None:
    box = Outbox(schema_dir=EVENT_SCHEMAS, routes={"*": "t"}, allow_unknown_types=True)
    encoded = box.encode(Event(type="order.refunded", key="k", data={"anything": [1]}))
    assert encoded.type == "order.refunded"
    assert "dataschema" not in encoded.envelope
    # Known types are still validated.
    with pytest.raises(DataSchemaViolation):
        box.encode(Event(type="order.created", key="k", data={"anything": [1]}))


def test_no_schema_dir_allows_any_type() -> None:
    box = Outbox(routes={"*": "t"})
    assert box.schemas is None
    for event_type in ("order.created", "whatever", "com.example.thing.v2"):
        encoded = box.encode(Event(type=event_type, key="k", data={"free": "form"}))
        assert encoded.type == event_type
    # Without schemas even a payload that breaks order.created.json is accepted.
    assert box.encode(Event(type="order.created", key="k", data={"currency": "eur"}))


def test_schema_dir_lists_shipped_types(outbox: Outbox) -> None:
    assert outbox.schemas is not None
    assert outbox.schemas.types == ["order.created", "order.paid", "order.shipped"]


def test_missing_schema_dir_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(SchemaError):
        Outbox(schema_dir=f"{tmp_path}/does-not-exist")


# --- queries.sql --------------------------------------------------------------------------


def _queries_source() -> str:
    return (
        resources.files("outbox_kafka.schema")
        .joinpath("sql", "queries.sql")
        .read_text(encoding="utf-8")
    )


def test_query_names_are_unique() -> None:
    names = re.findall(r"^-- name: (\S+)\s*$", _queries_source(), re.MULTILINE)
    assert "enqueue" in names
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
    assert list(raw_queries()) == names


@pytest.mark.parametrize(
    "names", [TableNames(), TableNames(table="orders_outbox", schema="app")], ids=str
)
def test_every_statement_renders_without_leftover_placeholders(names: TableNames) -> None:
    known = set(names.placeholders())
    for name, body in raw_queries().items():
        used = set(PLACEHOLDER.findall(body))
        assert used <= known, f"{name} uses unknown placeholders {sorted(used - known)}"
        rendered = render(body, names)
        assert PLACEHOLDER.findall(rendered) == [], name
        assert rendered.strip(), name
    for migration in raw_migrations():
        assert set(PLACEHOLDER.findall(migration.sql)) <= known, migration.name
    for migration in queries_for(names).migrations():
        assert PLACEHOLDER.findall(migration.sql) == [], migration.name


def test_enqueue_statement_targets_the_configured_tables() -> None:
    names = TableNames(table="orders_outbox", schema="app")
    sql = queries_for(names).sql["enqueue"]
    assert '"app"."orders_outbox"' in sql
    assert '"app"."orders_outbox_arrivals"' in sql
    assert '"app"."orders_outbox_key_seq"' in sql
    assert '"public"' not in sql
    assert "pg_notify" in sql


def test_migrations_are_numbered_from_one() -> None:
    versions = [m.version for m in raw_migrations()]
    assert versions == list(range(1, len(versions) + 1))
    assert versions[0] == 1


# --- identifiers --------------------------------------------------------------------------

BAD_IDENTIFIERS = ["Outbox", "a;drop", "1x", "", "a b", 'a"b', "a-b", "é", "outbox.events"]


@pytest.mark.parametrize("bad", [*BAD_IDENTIFIERS, "t" * 50], ids=repr)
def test_table_names_reject_bad_table(bad: str) -> None:
    with pytest.raises(InvalidIdentifier) as excinfo:
        TableNames(table=bad)
    assert repr(bad) in str(excinfo.value)


@pytest.mark.parametrize("bad", [*BAD_IDENTIFIERS, "s" * 64], ids=repr)
def test_table_names_reject_bad_schema(bad: str) -> None:
    with pytest.raises(InvalidIdentifier) as excinfo:
        TableNames(schema=bad)
    assert repr(bad) in str(excinfo.value)


def test_table_names_reject_non_strings() -> None:
    with pytest.raises(InvalidIdentifier):
        TableNames(table=None)  # type: ignore[arg-type]


def test_invalid_identifier_is_a_configuration_error() -> None:
    with pytest.raises(ConfigurationError):
        Outbox(table="Outbox")
    with pytest.raises(InvalidIdentifier):
        Outbox(db_schema="a;drop")


@pytest.mark.parametrize("good", ["outbox", "_x", "orders_outbox_2", "t" * 40])
def test_table_names_accept_plain_identifiers(good: str) -> None:
    names = TableNames(table=good, schema=good)
    assert names.events == good
    assert names.keys == f"{good}_keys"
    assert names.seqs == f"{good}_key_seq"
    assert names.floors == f"{good}_floors"
    assert names.placeholders()["floors"] == f'"{good}"."{good}_floors"'
    assert names.qualified_events == f"{good}.{good}"


def _longest_accepted(kind: str) -> str:
    """The longest name TableNames accepts for ``kind`` ("table" or "schema")."""
    for length in range(80, 0, -1):
        try:
            TableNames(**{kind: "x" * length})
        except InvalidIdentifier:
            continue
        return "x" * length
    raise AssertionError("no length accepted")


def test_every_derived_object_name_fits_postgres_limit() -> None:
    """PostgreSQL silently truncates identifiers over 63 bytes: every name must fit."""
    names = TableNames(table=_longest_accepted("table"))
    objects = [names.events, names.keys, names.seqs, names.arrivals, names.floors, names.versions]
    # The primary keys PostgreSQL names after their tables.
    objects += [f"{table}_pkey" for table in list(objects)]
    objects += [names.enqueue_one, names.enqueue_many]
    objects += [
        value.strip('"')
        for key, value in names.placeholders().items()
        if key.startswith(("events_", "keys_"))
    ]
    assert len(objects) == 21
    assert [name for name in objects if len(name.encode()) > 63] == []


def test_a_new_object_of_the_outbox_does_not_shorten_the_table_names_accepted() -> None:
    """An outbox named at the longest length a release accepted stays valid in the next."""
    assert len(_longest_accepted("table")) == 47


def test_notify_channel_fits_postgres_limit() -> None:
    """pg_notify() rejects channel names of 64 bytes or more ("channel name too long")."""
    for names in (
        TableNames(table=_longest_accepted("table")),
        TableNames(schema=_longest_accepted("schema")),
    ):
        assert len(names.channel.encode()) <= 63, names.channel


def test_lock_ids_differ_between_outboxes() -> None:
    a, b = TableNames(), TableNames(table="other")
    assert a.lock_id("migrate") == TableNames().lock_id("migrate")
    assert a.lock_id("migrate") != b.lock_id("migrate")
    assert -(2**63) <= a.lock_id("migrate") < 2**63
