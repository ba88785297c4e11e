"""Encoding events under one outbox's rules: its source, routes, schemas and limits."""

from __future__ import annotations

import fnmatch

from outbox_kafka.errors import (
    DataSchemaViolation,
    EnvelopeInvalid,
    MessageTooLarge,
    MissingTopic,
    UnknownEventType,
)
from outbox_kafka.producer.content_modes import ContentMode, binary_message
from outbox_kafka.producer.data import DataEncoder, JsonDefault
from outbox_kafka.producer.envelope import EncodedEvent, EnvelopeTemplate, structured_headers
from outbox_kafka.producer.event import Event, Route
from outbox_kafka.producer.event_checks import (
    cannot_hold,
    check_attribute,
    check_available_at,
    check_delay,
    check_event_id,
    check_headers,
    check_key,
    check_traceparent,
    check_type,
)
from outbox_kafka.producer.extensions import check_extensions
from outbox_kafka.producer.ids import uuid7
from outbox_kafka.producer.trace_context import current_traceparent
from outbox_kafka.topic_names import check_topic
from outbox_kafka.validation import CompiledSchema, EventSchemas, envelope_schema


class _EventKind:
    """What every event of one type from one source shares, worked out once."""

    __slots__ = ("schema", "template", "topic", "unknown")

    def __init__(
        self,
        template: EnvelopeTemplate,
        topic: str | None,
        schema: CompiledSchema | None,
        unknown: bool,
    ) -> None:
        self.template = template
        #: The routed topic, checked; None when no rule matches.
        self.topic = topic
        self.schema = schema
        #: A schema directory is configured, has no schema for the type, and
        #: unknown types are not allowed.
        self.unknown = unknown


#: Event kinds an ``EventEncoder`` keeps; past that (many distinct sources) it starts over.
_MAX_KINDS = 1024


class EventEncoder:
    """Validates events and encodes them exactly as they will be sent; writes nothing.

    What every event of one type from one source shares is worked out once
    and kept. Safe to share between threads.
    """

    def __init__(
        self,
        *,
        source: str,
        routes: list[Route],
        schemas: EventSchemas | None,
        allow_unknown_types: bool,
        max_key_bytes: int,
        max_message_bytes: int,
        json_default: JsonDefault | None = None,
        content_mode: ContentMode = "structured",
        id_header: str | None = None,
        holds: bool = True,
    ) -> None:
        self._data = DataEncoder(json_default)
        #: Whether events may be held back (``delay``, ``available_at``): not in the log.
        self.holds = holds
        #: The CloudEvents Kafka content mode events are stored in (content_modes.py).
        self.content_mode = content_mode
        #: The header each event's id is also sent in, if any; checked by the caller.
        self.id_header = id_header
        #: The source of events that name none; checked by the caller.
        self.source = source
        self.routes = routes
        self.schemas = schemas
        self.allow_unknown_types = allow_unknown_types
        self.max_key_bytes = max_key_bytes
        self.max_message_bytes = max_message_bytes
        self._kinds: dict[tuple[str, str | None], _EventKind] = {}

    def topic_for(self, event_type: str) -> str | None:
        """The topic the routing rules give ``event_type``, if any."""
        for route in self.routes:
            if route.pattern == event_type:
                return route.topic
        for route in self.routes:
            if fnmatch.fnmatchcase(event_type, route.pattern):
                return route.topic
        return None

    def _kind(self, event_type: object, source: object) -> _EventKind:
        """The checked, cached :class:`_EventKind` of ``event_type`` from ``source``."""
        # Only exact str keys: a subclass could hash or compare in its own way.
        key: tuple[str, str | None] | None = None
        if type(event_type) is str and (source is None or type(source) is str):
            key = (event_type, source)
            found = self._kinds.get(key)
            if found is not None:
                return found
        checked_type = check_type(event_type)
        checked_source = self.source if source is None else check_attribute("source", source)
        routed = self.topic_for(checked_type)
        schema = None if self.schemas is None else self.schemas.get(checked_type)
        kind = _EventKind(
            EnvelopeTemplate(
                checked_type, checked_source, None if schema is None else schema.schema_id
            ),
            topic=None if routed is None else check_topic(routed),
            schema=schema,
            unknown=self.schemas is not None and schema is None and not self.allow_unknown_types,
        )
        if key is not None:
            if len(self._kinds) >= _MAX_KINDS:
                self._kinds.clear()
            self._kinds[key] = kind
        return kind

    def encode(self, event: Event) -> EncodedEvent:
        """Validate and encode ``event`` exactly as it will be sent, or raise."""
        kind = self._kind(event.type, event.source)
        event_type = kind.template.event_type
        key_bytes = check_key(event.key, self.max_key_bytes)
        if event.topic is not None:
            topic = check_topic(event.topic)
        elif kind.topic is not None:
            topic = kind.topic
        else:
            raise MissingTopic(
                "topic", f"no topic given and no routing rule matches type {event_type!r}"
            )
        if event.event_id is None:
            event_id, id_text = uuid7.with_text()
        else:
            event_id = check_event_id(event.event_id)
            id_text = str(event_id)
        subject = None if event.subject is None else check_attribute("subject", event.subject)
        traceparent = (
            current_traceparent()
            if event.traceparent is None
            else check_traceparent(event.traceparent)
        )
        if not self.holds:
            # Before the values are checked: whatever the hold, it is refused.
            if event.available_at is not None:
                raise cannot_hold("available_at")
            if event.delay is not None:
                raise cannot_hold("delay")
        available_at = (
            None if event.available_at is None else check_available_at(event.available_at)
        )
        delay = None if event.delay is None else check_delay(event.delay, available_at)
        own_headers = check_headers(event.headers, self.id_header)
        extensions = () if event.extensions is None else check_extensions(event.extensions)

        data_json = self._data.encode(event.data)
        if kind.unknown and self.schemas is not None:
            raise UnknownEventType(
                "type",
                f"no schema {event_type}.json in {self.schemas.directory} "
                "(pass allow_unknown_types=True to accept it)",
            )
        envelope, value = kind.template.envelope(
            id_text, event.key, data_json, subject, traceparent, extensions
        )
        if kind.schema is not None:
            problem = kind.schema.payload_problem(event.data, data_json)
            if problem is not None:
                raise DataSchemaViolation("data", f"does not match {event_type}.json {problem}")
        # The attributes are plain strings, so the dict is exactly what was encoded.
        problem = envelope_schema().problem({**envelope, "data": None})
        if problem is not None:
            raise EnvelopeInvalid("envelope", problem)
        if self.content_mode == "binary":
            value, headers, stored_headers, header_bytes = binary_message(
                envelope, data_json, own_headers, self.id_header, extensions
            )
        else:
            headers, stored_headers, header_bytes = structured_headers(
                id_text, traceparent, own_headers, self.id_header
            )
        size = len(key_bytes) + len(value) + header_bytes
        if size > self.max_message_bytes:
            raise MessageTooLarge(
                "data",
                f"the encoded message is {size} bytes, over the maximum of "
                f"{self.max_message_bytes}",
            )
        return EncodedEvent(
            event_id,
            event.key,
            topic,
            event_type,
            value,
            headers,
            available_at,
            envelope,
            stored_headers,
            delay,
        )
