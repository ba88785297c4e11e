"""Arbitrary input to ``enqueue``: a clean OutboxError, or an event that arrives byte for byte.

Hypothesis generates payloads, keys, header names and values, types and
timestamps, well-formed or not. Each call either raises a subclass of
``OutboxError`` (and the caller's transaction stays usable), or writes an
event; every event written is then published by a relay and read back from
Kafka: the key, the value and every header exactly as given, the payload
as JSON would carry it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta, timezone
from decimal import Decimal
from typing import Any

import sqlalchemy as sa
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from outbox_kafka import Outbox, OutboxError
from outbox_kafka.producer.event_checks import RESERVED_HEADERS
from outbox_kafka.relay import Relay
from tests.relay_support import admit_arrivals, consume_all, make_settings
from tests.reliability.report import size

EXAMPLES = size(60, 1500)
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)

# ---------------------------------------------------------------------- strategies
# Each field is well formed three times out of four, so that a fair share of
# the calls are accepted and go all the way to Kafka.

#: Text of every kind: NUL, controls, astral characters, lone surrogates.
any_text = st.text(alphabet=st.characters(exclude_categories=()), max_size=40)
#: Text a producer may use: any Unicode scalar value but NUL.
clean_text = st.text(alphabet=st.characters(exclude_characters="\x00"), max_size=40)


def mostly(good: st.SearchStrategy[Any], bad: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(good, good, good, bad)


scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=-(10**40), max_value=10**40),
    st.floats(allow_nan=False, allow_infinity=False),
    clean_text,
)
json_values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(clean_text, inner, max_size=4),
        st.tuples(inner, inner),
    ),
    max_leaves=12,
)
hostile_data = st.one_of(
    st.floats().filter(lambda f: f != f or f in (float("inf"), float("-inf"))),
    any_text,
    st.sets(st.integers(), min_size=1, max_size=3),
    st.binary(max_size=8),
    st.builds(object),
    st.dictionaries(st.tuples(st.integers()), st.integers(), min_size=1, max_size=2),
    st.complex_numbers(),
    st.lists(st.recursive(st.none(), st.lists, max_leaves=3), max_size=2).map(
        lambda v: {"deep": v, "bad": float("nan")}
    ),
)
payloads = mostly(json_values, hostile_data)
keys = mostly(
    st.one_of(
        clean_text.filter(bool),
        st.text(alphabet=st.characters(exclude_characters="\x00"), min_size=250, max_size=300),
    ),
    st.one_of(
        any_text,
        st.text(min_size=1025, max_size=1100),
        st.just(""),
        st.just("a\x00b"),
        st.integers(),
        st.none(),
    ),
)
good_names = clean_text.filter(lambda n: bool(n) and n.lower() not in RESERVED_HEADERS)
good_values = st.one_of(clean_text, st.binary(max_size=40))
bad_names = st.one_of(
    any_text, st.sampled_from(sorted(RESERVED_HEADERS)), st.integers(), st.binary(max_size=4)
)
bad_values = st.one_of(any_text, st.integers(), st.none())
headers = mostly(
    st.one_of(
        st.none(),
        st.dictionaries(good_names, good_values, max_size=4),
        st.lists(st.tuples(good_names, good_values), max_size=4),
    ),
    st.one_of(
        st.dictionaries(bad_names, st.one_of(good_values, bad_values), min_size=1, max_size=3),
        st.lists(st.tuples(good_names, bad_values), min_size=1, max_size=2),
        st.lists(st.tuples(good_names), min_size=1, max_size=2),
        any_text,
        st.integers(),
    ),
)
types = mostly(
    clean_text.filter(lambda t: bool(t.strip())),
    st.one_of(any_text, st.just("   "), st.integers(), st.none()),
)
offsets = st.timedeltas(
    min_value=timedelta(hours=-23, minutes=-59), max_value=timedelta(hours=23, minutes=59)
)
zones = st.builds(timezone, offsets)
timestamps = mostly(
    st.one_of(
        st.none(),
        # Any offset Python allows, also beyond PostgreSQL's ±15:59 and with seconds.
        st.datetimes(
            min_value=datetime(1900, 1, 1), max_value=datetime(2200, 1, 1), timezones=zones
        ),
    ),
    st.one_of(
        st.datetimes(),  # naive
        st.datetimes(timezones=zones),  # any instant, possibly out of range in UTC
        st.just("2030-01-01T00:00:00Z"),
    ),
)


@dataclass(frozen=True)
class Written:
    event_id: str
    key: str
    type: str
    data: Any
    headers: list[tuple[str, bytes]]
    available_at: datetime | None


def expected_headers(given: Any) -> list[tuple[str, bytes]]:
    """The producer's headers as the message must carry them (only called for accepted input)."""
    if given is None:
        return []
    items = list(given.items()) if isinstance(given, dict) else list(given)
    return [(n, v if isinstance(v, bytes) else v.encode("utf-8")) for n, v in items]


def as_json(data: Any) -> Any:
    """What a JSON consumer reads for ``data`` (the standard library's own encoding)."""
    return json.loads(json.dumps(data, allow_nan=False))


def epoch_seconds(value: datetime) -> Decimal:
    delta = value - EPOCH
    return Decimal(delta.days * 86400 + delta.seconds) + Decimal(delta.microseconds) / 10**6


# ---------------------------------------------------------------------- the property


def test_enqueue_of_arbitrary_input_raises_cleanly_or_round_trips_byte_for_byte(
    engine: sa.Engine, database_url: str, kafka_bootstrap: str, new_topic: Callable[..., str]
) -> None:
    topic = new_topic(2)
    outbox = Outbox(allow_unknown_types=True, max_key_bytes=1024)
    written: list[Written] = []
    refused: dict[str, int] = {}

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(
        data=payloads, key=keys, given_headers=headers, event_type=types, available_at=timestamps
    )
    # Always among the examples: an offset PostgreSQL itself refuses (beyond ±15:59), with
    # binary and repeated headers; and input wrong in every field.
    @example(
        data={"a": [1, 2.5, None, "é", {"": True}]},
        key="clé-𝄞",
        given_headers=[("x-bin", b"\x00\xff"), ("x-bin", "again")],
        event_type="order.created",
        available_at=datetime(2020, 1, 1, tzinfo=timezone(timedelta(hours=20, minutes=30))),
    )
    @example(
        data=float("nan"),
        key="",
        given_headers={"ce_id": "x"},
        event_type=" ",
        available_at=datetime(2020, 1, 1),
    )
    def enqueue_once(
        data: Any, key: Any, given_headers: Any, event_type: Any, available_at: Any
    ) -> None:
        with engine.connect() as conn, conn.begin():
            try:
                event_id = outbox.enqueue(
                    conn,
                    type=event_type,
                    key=key,
                    data=data,
                    topic=topic,
                    headers=given_headers,
                    available_at=available_at,
                )
            except OutboxError as exc:
                refused[type(exc).__name__] = refused.get(type(exc).__name__, 0) + 1
                assert str(exc)
                # Nothing was written and the transaction is still usable.
                assert conn.execute(sa.text("SELECT 1")).scalar() == 1
                return
        # Accepted: the input was what the README allows.
        assert isinstance(key, str) and key and "\x00" not in key
        assert isinstance(event_type, str) and event_type.strip()
        assert isinstance(available_at, datetime | None)
        written.append(
            Written(
                str(event_id),
                key,
                event_type,
                as_json(data),
                expected_headers(given_headers),
                available_at,
            )
        )

    enqueue_once()
    assert written, "hypothesis produced no acceptable event"
    assert refused, "hypothesis produced no bad input"

    by_id = {w.event_id: w for w in written}
    # Delays are stored as given (the same instant), then moved to now so the
    # relay publishes everything in this run.
    admit_arrivals(engine)
    with engine.begin() as conn:
        stored: dict[str, Decimal] = dict(
            conn.execute(
                sa.text(
                    "SELECT CAST(event_id AS text), EXTRACT(EPOCH FROM available_at) FROM outbox"
                )
            ).all()
        )
        conn.execute(sa.text("UPDATE outbox SET available_at = now()"))
        conn.execute(sa.text("UPDATE outbox_keys SET due_at = now()"))
    assert set(stored) == set(by_id)
    for event_id, w in by_id.items():
        if w.available_at is not None:
            assert stored[event_id] == epoch_seconds(w.available_at), w.available_at

    relay = Relay(make_settings(database_url, kafka_bootstrap))
    try:
        report = relay.drain()
    finally:
        relay.close()
    assert (report.delivered, report.discarded) == (len(written), 0)

    records = consume_all(kafka_bootstrap, topic, len(written))
    assert sorted(r.event_id for r in records) == sorted(by_id)
    for r in records:
        w = by_id[r.event_id]
        assert r.key_bytes == w.key.encode("utf-8")
        assert r.header_list[0] == ("content-type", b"application/cloudevents+json")
        assert r.header_list[1:] == w.headers
        envelope = json.loads(r.raw)
        assert (envelope["id"], envelope["type"], envelope["partitionkey"]) == (
            w.event_id,
            w.type,
            w.key,
        )
        assert envelope["data"] == w.data, (envelope["data"], w.data)
    with engine.connect() as conn:
        values: dict[str, bytes] = dict(
            conn.execute(sa.text("SELECT CAST(event_id AS text), value FROM outbox")).all()
        )
    assert all(r.raw == bytes(values[r.event_id]) for r in records)
