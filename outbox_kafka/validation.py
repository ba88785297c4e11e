"""JSON Schema validation of envelopes and payloads, compiled once and cached."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema_rs

from outbox_kafka.errors import SchemaError

_PACKAGE_DIR = Path(__file__).resolve().parent


def shipped_schema_dir() -> Path:
    """The ``schemas/`` directory shipped with the package (or the source tree)."""
    for candidate in (_PACKAGE_DIR / "_schemas", _PACKAGE_DIR.parent / "schemas"):
        if (candidate / "cloudevent.json").is_file():
            return candidate
    raise SchemaError("the shipped schemas/cloudevent.json cannot be found")


def _compile(path: Path) -> tuple[jsonschema_rs.Validator, dict[str, Any]]:
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise SchemaError(f"cannot read JSON Schema {path}: {exc}") from exc
    if not isinstance(document, dict):
        raise SchemaError(f"{path} does not hold a JSON Schema object")
    try:
        validator = jsonschema_rs.validator_for(document)
    except (ValueError, jsonschema_rs.ValidationError) as exc:
        raise SchemaError(f"{path} is not a valid JSON Schema: {exc}") from exc
    return validator, document


def describe(error: jsonschema_rs.ValidationError) -> str:
    """A one-line description of a validation error, with where it happened."""
    where = "/".join(str(part) for part in error.instance_path)
    return f"at /{where}: {error.message}" if where else error.message


class CompiledSchema:
    """One compiled schema; ``errors(instance)`` lists what is wrong, if anything."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._validator, document = _compile(path)
        schema_id = document.get("$id")
        self.schema_id: str | None = schema_id if isinstance(schema_id, str) else None

    def is_valid(self, instance: Any) -> bool:
        return bool(self._validator.is_valid(instance))

    def first_error(self, instance: Any) -> str | None:
        for error in self._validator.iter_errors(instance):
            return describe(error)
        return None

    def problem(self, instance: Any) -> str | None:
        """What is wrong with ``instance`` (as :meth:`first_error`), cheaply when nothing is."""
        if self._validator.is_valid(instance):
            return None
        return self.first_error(instance)

    def payload_problem(self, data: Any, data_json: str) -> str | None:
        """What is wrong with a payload as consumers will see it: ``data_json`` decoded.

        A payload built of JSON's own Python types (dict with str keys, list,
        str, int, float, bool, None; no subclasses) decodes to an equal value,
        so it is validated as it is, without decoding. Anything else (tuples,
        non-str keys, subclasses the validator does not map as JSON does) is
        validated in its decoded form, and so is every payload found invalid,
        so that the decision and the message always concern what is sent.
        """
        if _is_plain_json(data) and self._validator.is_valid(data):
            return None
        return self.problem(json.loads(data_json))


_SCALARS = frozenset({str, int, float, bool, type(None)})
#: Values looked at before a payload counts as too big to check in Python.
_PLAIN_JSON_BUDGET = 256


def _is_plain_json(data: Any) -> bool:
    """Whether ``data`` is built only of JSON's own Python types, in a small budget.

    A large payload answers False: decoding it in C costs less than walking it here.
    """
    if type(data) in _SCALARS:
        return True
    stack = [data]
    budget = _PLAIN_JSON_BUDGET
    while stack:
        node = stack.pop()
        kind = type(node)
        if kind is dict:
            budget -= len(node)
            if budget < 0:
                return False
            for key, value in node.items():
                if type(key) is not str:
                    return False
                if type(value) not in _SCALARS:
                    stack.append(value)
        elif kind is list:
            budget -= len(node)
            if budget < 0:
                return False
            stack.extend(item for item in node if type(item) not in _SCALARS)
        elif kind not in _SCALARS:
            return False
    return True


@cache
def envelope_schema() -> CompiledSchema:
    """The CloudEvents envelope schema every event must satisfy."""
    return CompiledSchema(shipped_schema_dir() / "cloudevent.json")


class EventSchemas:
    """Payload schemas of one directory: ``<dir>/<event type>.json``.

    Every file is compiled when the directory is loaded, so a broken schema
    fails at start-up rather than on the first event of its type.
    """

    def __init__(self, directory: Path | str) -> None:
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise SchemaError(f"schema directory {self.directory} does not exist")
        self._schemas = {
            path.name[: -len(".json")]: CompiledSchema(path)
            for path in sorted(self.directory.glob("*.json"))
        }

    @property
    def types(self) -> list[str]:
        return sorted(self._schemas)

    def get(self, event_type: str) -> CompiledSchema | None:
        return self._schemas.get(event_type)


@cache
def load_event_schemas(directory: str) -> EventSchemas:
    """Compiled payload schemas of ``directory``, shared by every ``Outbox`` using it."""
    return EventSchemas(directory)
