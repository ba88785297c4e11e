"""How an event's ``data`` becomes JSON: strict JSON of the types services hold
(dates and times, decimals, UUIDs, enums, dataclasses, pydantic models), and a
hook for the rest."""

from __future__ import annotations

import dataclasses
import datetime as dt
import decimal
import enum
import json
import uuid
from collections.abc import Callable
from typing import Any

from outbox_kafka.errors import InvalidData

#: An outbox's hook for values the built-in conversions do not know: return
#: something JSON can encode, or raise TypeError.
JsonDefault = Callable[[Any], Any]


def builtin_default(value: Any) -> Any:
    """The JSON form of a value of a type services commonly put in events.

    - ``datetime``, ``date``, ``time``: ISO 8601 text (``isoformat()``; a
      datetime without a time zone stays without one);
    - ``Decimal``: its exact text (``"12.50"``), a string, since a JSON number
      would be read back as a float by most consumers; NaN and infinities are
      refused like float ones;
    - ``UUID``: its canonical text; ``Enum``: its value;
    - a dataclass instance: a dict of its fields; a pydantic model: its
      ``model_dump(mode="json")``.

    Raises TypeError for anything else.
    """
    if isinstance(value, (dt.datetime, dt.date, dt.time)):
        return value.isoformat()
    if isinstance(value, decimal.Decimal):
        if not value.is_finite():
            raise ValueError(f"Out of range decimal value: {value}")
        return str(value)
    if isinstance(value, uuid.UUID):
        return str(value)
    if isinstance(value, enum.Enum):
        return value.value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    model_dump = getattr(value, "model_dump", None)
    if callable(model_dump) and not isinstance(value, type):
        return model_dump(mode="json")
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


class DataEncoder:
    """Encodes payloads as strict JSON (no NaN or Infinity), with ``json_default``
    for the types :func:`builtin_default` does not know."""

    def __init__(self, json_default: JsonDefault | None = None) -> None:
        self._hook = json_default

        def default(value: Any) -> Any:
            try:
                return builtin_default(value)
            except TypeError:
                if self._hook is None:
                    raise
            return self._hook(value)

        self._encoder = json.JSONEncoder(
            allow_nan=False, ensure_ascii=False, separators=(",", ":"), default=default
        )

    def encode(self, data: Any) -> str:
        """``data`` as JSON text, or raise :class:`~outbox_kafka.InvalidData` naming why."""
        try:
            return self._encoder.encode(data)
        except ValueError as exc:
            raise InvalidData("data", f"is not strict JSON: {exc}") from exc
        except (TypeError, RecursionError) as exc:
            hint = "" if self._hook is not None else " (Outbox(json_default=...) converts others)"
            raise InvalidData("data", f"is not JSON-serializable: {exc}{hint}") from exc
