"""Which events, or parked keys, an operator action applies to."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from outbox_kafka.errors import InvalidSelection
from outbox_kafka.schema.statements import pg_text_array


@dataclass(frozen=True)
class Selection:
    """Which events (or parked keys) an operator action applies to.

    Selectors combine with AND; repeated values of one selector with OR. A
    time range is ``since <= created_at < until``. An empty selection selects
    nothing and is refused; ``everything=True`` (``--all``) selects every
    event and cannot be combined with selectors.
    """

    event_ids: tuple[str, ...] = ()
    keys: tuple[str, ...] = ()
    types: tuple[str, ...] = ()
    topics: tuple[str, ...] = ()
    since: datetime | None = None
    until: datetime | None = None
    everything: bool = False

    def __post_init__(self) -> None:
        ids = []
        for raw in self.event_ids:
            try:
                ids.append(str(uuid.UUID(str(raw))))
            except ValueError:
                raise InvalidSelection(f"event id {raw!r} is not a UUID") from None
        object.__setattr__(self, "event_ids", tuple(ids))
        for name in ("keys", "types", "topics"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        for name in ("since", "until"):
            value = getattr(self, name)
            if value is not None and value.utcoffset() is None:
                raise InvalidSelection(f"{name} {value.isoformat()} has no time zone")
        if self.since is not None and self.until is not None and self.since >= self.until:
            raise InvalidSelection(
                f"empty time range: since ({self.since.isoformat()}) is not before "
                f"until ({self.until.isoformat()})"
            )
        if self.everything and not self.is_empty:
            raise InvalidSelection("--all (everything) cannot be combined with selectors")

    @property
    def is_empty(self) -> bool:
        """No selector given (``everything`` aside)."""
        return not (
            self.event_ids or self.keys or self.types or self.topics or self.since or self.until
        )

    def require(self, what: str) -> None:
        if self.is_empty and not self.everything:
            raise InvalidSelection(
                f"nothing selected: say which {what} (--event-id, --key, --type, --topic, "
                "--since, --until), or --all for every one of them"
            )

    def params(self) -> dict[str, Any]:
        """The statements' parameters; a selector not given is NULL (matches everything)."""
        arrays = {
            "event_ids": self.event_ids,
            "ordering_keys": self.keys,
            "types": self.types,
            "topics": self.topics,
        }
        return {
            **{name: pg_text_array(values) if values else None for name, values in arrays.items()},
            "since": self.since,
            "until": self.until,
        }
