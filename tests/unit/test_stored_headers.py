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


CONTENT_TYPE = ("content-type", b"application/cloudevents+json")
#: Headers stored by earlier versions, which put the id in ``ce_id`` and the type,
#: source and spec version in headers of their own.
EARLIER_HEADERS = [
    ("ce_type", b"order.paid"),
    ("ce_source", b"/orders"),
    ("ce_specversion", b"1.0"),
]


@pytest.mark.parametrize(
    ("id_header", "after_id"),
    [("id", []), ("ce_id", EARLIER_HEADERS), ("x-event-id", [("traceparent", b"00-aa")])],
    ids=["id header", "earlier versions", "id then traceparent"],
)
@given(
    ids=st.lists(st.uuids().map(str), min_size=2, max_size=5),
    own=st.lists(st.tuples(st.text(max_size=20), header_values), max_size=3),
)
def test_headers_around_the_id_read_once_are_the_same_for_every_id(
    id_header: str, after_id: list[tuple[str, bytes]], ids: list[str], own: list[tuple[str, bytes]]
) -> None:
    """The library's headers, then a producer's own: what comes around the id is read once
    and kept."""
    for event_id in ids:
        headers = [CONTENT_TYPE, (id_header, event_id.encode()), *after_id, *own]
        stored = jsonb_text(json.loads(headers_to_json(headers)))
        assert headers_from_text(stored) == headers == reference(stored)


@given(st.lists(st.tuples(st.text(max_size=20), header_values), max_size=3))
def test_the_second_header_may_be_anything_of_the_producers(
    own: list[tuple[str, bytes]],
) -> None:
    for _ in range(2):
        stored = jsonb_text(json.loads(headers_to_json([CONTENT_TYPE, *own])))
        assert headers_from_text(stored) == [CONTENT_TYPE, *own] == reference(stored)


@pytest.mark.parametrize(
    "tail",
    ['"], ["ce_type", "x"]]', '"]]', '"], ["a", {"base64": "!!"}]]', '"], ["a"]]', '"', ""],
)
@pytest.mark.parametrize(
    "head",
    [
        '[["content-type", "application/cloudevents+json"], ["ce_id", "',
        '[["content-type", "application/cloudevents+json"], ["id", "',
        '[["content-type", "application/cloudevents+json"], ["b", {"base64": "AA=="}], ["id", "',
        '[["content-type", "application/cloudevents+json"], ["a\\"", "',
    ],
)
def test_a_kept_form_gives_what_reading_in_full_gives(head: str, tail: str) -> None:
    for event_id in ("first", "second", "third"):
        stored = head + event_id + tail
        assert headers_from_text(stored) == reference(stored), stored


def test_content_type_alone_is_read_as_such() -> None:
    stored = '[["content-type", "application/cloudevents+json"]]'
    assert headers_from_text(stored) == [CONTENT_TYPE] == reference(stored)


@pytest.mark.parametrize("odd", ["a\nb", "a\x00b", "a\ud800b"], ids=["newline", "nul", "surrogate"])
def test_text_jsonb_never_prints_is_refused_as_reading_in_full_refuses_it(odd: str) -> None:
    """Raw control characters and lone surrogates: JSON refuses them, and so do the fast
    paths, with a form kept from an earlier event or without."""
    head = '[["content-type", "application/cloudevents+json"], ["id", "'
    assert headers_from_text(head + 'abc"]]') == reference(head + 'abc"]]')
    for stored in (head + odd + '"]]', f'[["a", "{odd}"]]'):
        assert reference(stored) is None
        assert headers_from_text(stored) is None, stored
