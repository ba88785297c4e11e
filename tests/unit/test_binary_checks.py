"""The relay's check of a binary-mode event's ce_ headers before sending it."""

from __future__ import annotations

import pytest

from outbox_kafka import Event, Outbox
from outbox_kafka.relay.claim import check_binary_attributes, is_binary_mode


def _headers() -> tuple[list[tuple[str, bytes]], str]:
    encoded = Outbox(allow_unknown_types=True, content_mode="binary").encode(
        Event(type="t.e", key="k-1", data={"a": 1}, topic="t")
    )
    return encoded.headers, str(encoded.event_id)


def test_a_binary_event_as_enqueue_stored_it_passes() -> None:
    headers, event_id = _headers()
    assert is_binary_mode(headers)
    assert check_binary_attributes(headers, event_id, "k-1") is None


def test_a_structured_event_is_not_taken_for_a_binary_one() -> None:
    encoded = Outbox(allow_unknown_types=True).encode(
        Event(type="t.e", key="k-1", data={"a": 1}, topic="t")
    )
    assert not is_binary_mode(encoded.headers)


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        (("ce_id", b"00000000-0000-0000-0000-000000000000"), "ce_id does not match the event id"),
        (("ce_partitionkey", b"k-2"), "ce_partitionkey does not match the ordering key"),
        (("ce_specversion", b"0.3"), "ce_specversion is not 1.0"),
        (("ce_type", None), "no ce_type header"),
        (("ce_source", None), "no ce_source header"),
    ],
)
def test_a_tampered_binary_event_is_refused_naming_the_header(
    change: tuple[str, bytes | None], problem: str
) -> None:
    headers, event_id = _headers()
    name, value = change
    changed = [
        (n, value if n == name else v) for n, v in headers if not (n == name and value is None)
    ]
    found = check_binary_attributes([(n, v) for n, v in changed if v is not None], event_id, "k-1")
    assert found == f"binary mode: {problem}"
