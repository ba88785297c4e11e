"""The claim hands the relay each stored value byte for byte, whatever the bytes are."""

from __future__ import annotations

import sqlalchemy as sa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from outbox_kafka import Event
from outbox_kafka.naming import TableNames
from outbox_kafka.relay.store import Store
from tests.relay_support import topic_outbox

#: Values the claim's escape format treats specially, next to plain ones.
AWKWARD = [
    b"",
    b"\\",
    b"\\\\",
    b"\\000",
    b"\\x41",
    b"\x00",
    b"\x00\x01\x7f\x80\xff",
    bytes(range(256)),
    '{"name": "Zoë \\"quoted\\"\\n", "emoji": "🦀"}'.encode(),
    b'{"plain": "ascii only"}',
]


def _claimed_values(engine: sa.Engine, database_url: str, values: list[bytes]) -> list[bytes]:
    """Store ``values`` as the values of pending events on one key; what one claim returns."""
    outbox = topic_outbox()
    with engine.begin() as conn:
        conn.execute(sa.text("TRUNCATE outbox, outbox_keys, outbox_key_seq"))
        ids = outbox.enqueue_many(
            conn, [Event(type="t.e", key="K", data={}, topic="t") for _ in values]
        )
        for event_id, value in zip(ids, values, strict=True):
            conn.execute(
                sa.text("UPDATE outbox SET value = :value WHERE event_id = :id"),
                {"value": value, "id": event_id},
            )
    store = Store(database_url, TableNames())
    try:
        claim = store.claim(batch_size=len(values) + 1, lease_seconds=30)
    finally:
        store.close()
    [key] = claim.keys
    assert [e.event_id for e in key.events] == [str(i) for i in ids]
    for event in key.events:
        # The text form, when given, is the value itself.
        assert event.text is None or event.text.encode() == event.value
    return [e.value for e in key.events]


def test_awkward_values_come_back_exactly(engine: sa.Engine, database_url: str) -> None:
    assert _claimed_values(engine, database_url, AWKWARD) == AWKWARD


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.lists(st.binary(max_size=300), min_size=1, max_size=20))
def test_any_values_come_back_exactly(
    engine: sa.Engine, database_url: str, values: list[bytes]
) -> None:
    assert _claimed_values(engine, database_url, values) == values


def test_utf8_values_come_as_text_and_one_that_is_not_leaves_the_claim_whole(
    engine: sa.Engine, database_url: str
) -> None:
    text_values = [
        '{"name": "Zoë \\"quoted\\"\\n", "emoji": "🦀"}'.encode(),
        b'{"back\\\\slash": "\\\\000"}',
    ]
    assert _claimed_values(engine, database_url, text_values) == text_values
    outbox = topic_outbox()
    store = Store(database_url, TableNames())
    try:
        with engine.begin() as conn:
            conn.execute(sa.text("TRUNCATE outbox, outbox_keys, outbox_key_seq"))
            outbox.enqueue_many(
                conn, [Event(type="t.e", key=f"K{i}", data={}, topic="t") for i in range(3)]
            )
            conn.execute(sa.text("UPDATE outbox SET value = '\\xc3' WHERE ordering_key = 'K1'"))
        claim = store.claim(batch_size=10, lease_seconds=30)
        values = {k.key: [e.value for e in k.events] for k in claim.keys}
        texts = {k.key: [e.text for e in k.events] for k in claim.keys}
        # The claim fell back to the escape format for all of its values.
        assert values["K1"] == [b"\xc3"] and texts["K1"] == [None]
        assert set(values) == {"K0", "K1", "K2"}
        with engine.begin() as conn:
            leased = conn.execute(
                sa.text("SELECT count(*) FROM outbox_keys WHERE claim_token IS NOT NULL")
            ).scalar_one()
        assert leased == 3
        # Once that value is gone, claims read text again.
        with engine.begin() as conn:
            conn.execute(sa.text("UPDATE outbox_keys SET claim_token = NULL, due_at = now()"))
            conn.execute(
                sa.text("UPDATE outbox SET value = :value WHERE ordering_key = 'K1'"),
                {"value": text_values[0]},
            )
        claim = store.claim(batch_size=10, lease_seconds=30)
        # In the escape format, this value's "ë" and backslashes would have been escaped.
        [k1] = [k for k in claim.keys if k.key == "K1"]
        assert [(e.value, e.text) for e in k1.events] == [(text_values[0], text_values[0].decode())]
        assert sum(len(k.events) for k in claim.keys) == 3
    finally:
        store.close()
