"""What the relay checks of each claimed event before sending it, and which of a key's
claimed events may go out in one batch. The checks need no broker."""

from __future__ import annotations

import json

from outbox_kafka.errors import EventError
from outbox_kafka.limits import enqueue_limit_for
from outbox_kafka.producer.checks import check_topic
from outbox_kafka.relay.batches import Claim, ClaimedEvent, ClaimedKey
from outbox_kafka.relay.verdicts import Problem, Verdict
from outbox_kafka.stored_headers import message_size
from outbox_kafka.validation import envelope_schema


def sendable(key: ClaimedKey) -> list[ClaimedEvent]:
    """The key's claimed events that may go out in this batch: the due ones, in order,
    up to the first for another topic than the first's.

    Kafka orders messages within a partition only, so an event for another topic
    could land while an earlier one of its key is still unacknowledged and then
    fails. It goes in a later batch, once everything before it is recorded.
    """
    run: list[ClaimedEvent] = []
    for event in key.events:
        if not event.due or event.topic != key.events[0].topic:
            break
        run.append(event)
    return run


def check_envelope(value: bytes | str, event_id: str, key: str) -> str | None:
    """Why ``value`` (the bytes, or their text) is not a sendable envelope, or None."""
    try:
        envelope = json.loads(value)
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
