"""The relay's reading of stored headers from jsonb's text form.

``headers_from_text`` has a fast path for the common case (no escapes, no
base64 values) and a JSON fallback; both must agree with the JSON reading of
the same text for every input, well-formed or not.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from outbox_kafka.stored_headers import headers_from_json, headers_from_text, headers_to_json


def jsonb_text(value: object) -> str:
    """The text PostgreSQL prints for a jsonb value: ", " and ": " separators, UTF-8 kept."""
    return json.dumps(value, ensure_ascii=False, separators=(", ", ": "))


def reference(stored: str) -> list[tuple[str, bytes]] | None:
    try:
        return headers_from_json(json.loads(stored))
    except ValueError:
        return None


header_values = st.one_of(st.binary(max_size=40), st.text(max_size=40).map(str.encode))
header_lists = st.lists(st.tuples(st.text(max_size=20), header_values), max_size=8)


@given(header_lists)
def test_stored_headers_read_back_byte_for_byte(headers: list[tuple[str, bytes]]) -> None:
    stored = jsonb_text(json.loads(headers_to_json(headers)))
    assert headers_from_text(stored) == headers


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner),
    max_leaves=12,
)


@given(json_values)
def test_any_json_reads_as_the_json_reading_does(value: object) -> None:
    stored = jsonb_text(value)
    assert headers_from_text(stored) == reference(stored)


@pytest.mark.parametrize(
    "stored",
    [
        '[["a", "b"]',
        '[["a", "b"]]]',
        '[["a", "b"] , ["c", "d"]]',
        '[["a", "b"], ["c"]]',
        '[["a", "b", "c", "d"]]',
        '[["a" "b"]]',
        "not json",
        "",
    ],
)
def test_text_that_only_looks_like_headers_is_not_taken_for_them(stored: str) -> None:
    assert headers_from_text(stored) == reference(stored)


LIBRARY_HEADERS = [
    ("content-type", b"application/cloudevents+json"),
    ("ce_id", b"00000000-0000-0000-0000-000000000000"),
    ("ce_type", b"order.paid"),
    ("ce_source", b"/orders"),
    ("ce_specversion", b"1.0"),
]


@given(
    st.lists(st.uuids().map(str), min_size=2, max_size=5),
    st.lists(st.tuples(st.text(max_size=20), header_values), max_size=3),
)
def test_headers_after_the_id_read_once_are_the_same_for_every_id(
    ids: list[str], own: list[tuple[str, bytes]]
) -> None:
    """The library's headers, then a producer's own: what follows the id is read once and kept."""
    for event_id in ids:
        headers = [LIBRARY_HEADERS[0], ("ce_id", event_id.encode()), *LIBRARY_HEADERS[2:], *own]
        stored = jsonb_text(json.loads(headers_to_json(headers)))
        assert headers_from_text(stored) == headers == reference(stored)


@pytest.mark.parametrize(
    "tail",
    ['"], ["ce_type", "x"]]', '"]]', '"], ["a", {"base64": "!!"}]]', '"], ["a"]]', '"', ""],
)
def test_a_kept_tail_gives_what_reading_in_full_gives(tail: str) -> None:
    head = '[["content-type", "application/cloudevents+json"], ["ce_id", "'
    for event_id in ("first", "second", "third"):
        stored = head + event_id + tail
        assert headers_from_text(stored) == reference(stored), stored
