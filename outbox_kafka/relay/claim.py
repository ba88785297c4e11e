"""The claim step: how many keys a claim asks for, the claim itself (one short
transaction in the store), when to read the next claim ahead, and the checks of each
claimed event before it may be sent. The checks need no broker, so a claim read
ahead is checked while the batch before it waits for its acknowledgements."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from outbox_kafka.errors import EventError
from outbox_kafka.limits import enqueue_limit_for
from outbox_kafka.relay.batch import Claim, ClaimedEvent, Problem, Verdict
from outbox_kafka.relay.decide import sendable
from outbox_kafka.relay.observe import RelayObserver
from outbox_kafka.stored_headers import message_size
from outbox_kafka.topic_names import check_topic
from outbox_kafka.validation import envelope_schema


class Claimed(NamedTuple):
    """A claim, how many keys it asked for, and what its events' own checks found."""

    claim: Claim
    asked: int
    #: By ``id(event)``: the problem of the first event of a key that fails a check.
    problems: dict[int, Problem]
    #: ``time.monotonic()`` when the claim was asked for: its lease began after.
    asked_at: float


class Claimer:
    """The claim step of one relay loop: lease due keys, read their next events, check them.

    ``take(max_keys)`` runs the store's claim (through the loop's database
    retries); the claimer chooses how many keys each claim asks for.
    """

    def __init__(
        self,
        take: Callable[[int], Claim],
        *,
        batch_size: int,
        max_message_bytes: int,
        observer: RelayObserver,
    ) -> None:
        self._take = take
        self.observer = observer
        self._checks = EventChecks(max_message_bytes)
        self._sizer = ClaimSizer(batch_size)

    def claim(self) -> Claimed:
        """Lease due keys, read their next events and check them."""
        started = time.monotonic()
        keys_wanted = self._sizer.keys_per_claim
        claim = self._take(keys_wanted)
        self.observer.claimed(claim, time.monotonic() - started)
        return Claimed(claim, keys_wanted, self._checks.first_problems(claim), started)

    def adapt(self, claimed: Claimed) -> None:
        """Size the next claim after ``claimed``, about to be sent."""
        self._sizer.adapt(claimed.claim, claimed.asked)


def worth_reading_ahead(claim: Claim, asked: int, batch_size: int) -> bool:
    """Whether to read the next claim while this one is sent.

    Only when the relay is behind: the claim filled half the batch or ran
    out of keys to ask for. A claim read ahead is taken before the events
    committed during the send, so when the relay keeps up, reading ahead
    would make every event wait one cycle more.
    """
    if not any(k.events and k.events[0].due for k in claim.keys):
        return False
    return claim.event_count * 2 >= batch_size or len(claim.keys) >= asked


class ClaimSizer:
    """Claim fewer keys when keys have several events waiting, more when they have few.

    Most of a cycle's database work is per key (lease, release), so a backlog
    of a few events on each of many keys is best served a few events per key,
    not one; a hot key already gets the whole batch.
    """

    def __init__(self, batch_size: int) -> None:
        self.batch_size = batch_size
        #: How many keys the next claim asks for.
        self.keys_per_claim = batch_size

    def adapt(self, claim: Claim, asked: int) -> None:
        """Size the next claim after ``claim``, which asked for ``asked`` keys."""
        batch = self.batch_size
        if not claim.keys or any(k.withheld for k in claim.keys):
            # The byte budget, not the number of keys, bounded this claim.
            return
        # What each key can send now: a key whose events switch topics sends
        # only its first run, however many events it brought.
        runs = [len(sendable(k)) for k in claim.keys]
        # Keys that can send their whole share of the batch and had more waiting.
        full = sum(
            1
            for k, run in zip(claim.keys, runs, strict=True)
            if run >= claim.per_key_limit and (k.last_seq is None or k.waiting > len(k.events))
        )
        floor = max(1, batch // 64)
        if full * 2 > len(claim.keys) > floor:
            # Also when fewer keys were due than asked for: what counts is that
            # most keys had more waiting than their share of the batch. Enough
            # keys for a full batch at the typical key's backlog, at most half.
            waiting = sorted(k.waiting for k in claim.keys)[len(claim.keys) // 2]
            self.keys_per_claim = max(floor, min(len(claim.keys) // 2, batch // waiting))
        elif sum(runs) * 4 < batch * 3 and len(claim.keys) >= asked and asked < batch:
            self.keys_per_claim = min(batch, asked * 2)


#: Decodes an envelope's text where it begins, without :func:`json.loads`'s own
#: Python steps (its type checks, its whitespace matches): at one envelope per
#: event, those cost more than half as much as the decoding itself.
_DECODER = json.JSONDecoder()


def decode_envelope(value: bytes | str) -> Any:
    """``json.loads(value)``, faster for text that is one JSON value from its first
    character to its last (as envelopes are written); the same result or error."""
    if isinstance(value, str):
        try:
            decoded, end = _DECODER.raw_decode(value)
        except ValueError:
            pass  # whitespace first, or not JSON: json.loads says which
        else:
            if end == len(value):
                return decoded
    return json.loads(value)


def check_envelope(value: bytes | str, event_id: str, key: str) -> str | None:
    """Why ``value`` (the bytes, or their text) is not a sendable envelope, or None."""
    try:
        envelope = decode_envelope(value)
    except ValueError as exc:
        return f"envelope is not JSON: {exc}"
    except RecursionError:
        return "envelope is not JSON the relay can read: nested too deeply"
    schema = envelope_schema()
    if not schema.is_valid(envelope):
        return f"envelope fails schemas/cloudevent.json: {schema.first_error(envelope)}"
    if envelope.get("id") != event_id:
        return "envelope id does not match the event id"
    if envelope.get("partitionkey") != key:
        return "envelope partitionkey does not match the ordering key"
    return None


def is_binary_mode(headers: list[tuple[str, bytes]]) -> bool:
    """Whether stored headers are of an event in binary content mode.

    Such an event's ``content-type`` is its data's, not the CloudEvents
    format's, and its attributes are ``ce_`` headers (producer/content_modes.py).
    """
    for name, value in headers:
        if name == "content-type":
            return not value.startswith(b"application/cloudevents")
    return False


def check_binary_attributes(
    headers: list[tuple[str, bytes]], event_id: str, key: str
) -> str | None:
    """Why the ``ce_`` headers of a binary-mode event are not sendable, or None."""
    found = {name: value for name, value in headers if name.startswith("ce_")}
    for name in ("ce_specversion", "ce_id", "ce_source", "ce_type"):
        if not found.get(name):
            return f"binary mode: no {name} header"
    if found["ce_specversion"] != b"1.0":
        return "binary mode: ce_specversion is not 1.0"
    if found["ce_id"] != event_id.encode():
        return "binary mode: ce_id does not match the event id"
    if found.get("ce_partitionkey") != key.encode("utf-8"):
        return "binary mode: ce_partitionkey does not match the ordering key"
    return None


class EventChecks:
    """Checks one event on its own: topic name, envelope, stored headers, size."""

    def __init__(self, max_message_bytes: int) -> None:
        self.max_message_bytes = max_message_bytes
        self._valid_topics: set[str] = set()

    def problem(self, event: ClaimedEvent, key: bytes) -> Problem | None:
        """What is wrong with the event itself, if anything."""
        if event.topic not in self._valid_topics:
            try:
                check_topic(event.topic)
            except EventError as exc:
                return Verdict.PERMANENT, f"INVALID_TOPIC: {exc.reason}"
            self._valid_topics.add(event.topic)
        if event.headers is None:
            return (
                Verdict.PERMANENT,
                "INVALID_HEADERS: the stored headers are not [[name, value], ...]",
            )
        if is_binary_mode(event.headers):
            problem = check_binary_attributes(event.headers, event.event_id, event.key)
        else:
            text = event.text
            value = event.value if text is None else text
            problem = check_envelope(value, event.event_id, event.key)
        if problem is not None:
            return Verdict.PERMANENT, f"INVALID_ENVELOPE: {problem}"
        size = message_size(key, event.value, event.headers)
        if size > self.max_message_bytes:
            return (
                Verdict.PERMANENT,
                f"MSG_SIZE_TOO_LARGE: message is {size} bytes, over the relay's "
                f"message.max.bytes ({self.max_message_bytes}; producers of this "
                "relay should pass max_message_bytes="
                f"{enqueue_limit_for(self.max_message_bytes)} to Outbox)",
            )
        return None

    def first_problems(self, claim: Claim) -> dict[int, Problem]:
        """By ``id(event)``: the first sendable event of each key that fails a check."""
        problems: dict[int, Problem] = {}
        for claimed in claim.keys:
            key = claimed.key.encode()
            for event in sendable(claimed):
                problem = self.problem(event, key)
                if problem is not None:
                    problems[id(event)] = problem
                    break
        return problems
