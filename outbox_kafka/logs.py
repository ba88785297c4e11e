"""Log set-up: one action per record, structured fields, text or JSON.

Records carry their fields as ``extra={"action": ..., ...}``; the formatters
here print them after the message (text) or as keys (JSON).
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime

# Attributes every LogRecord has; anything else was passed through ``extra``.
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message",
    "asctime",
    "taskName",
}


def fields_of(record: logging.LogRecord) -> dict[str, object]:
    """The structured fields a record carries."""
    return {k: v for k, v in vars(record).items() if k not in _STANDARD and not k.startswith("_")}


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        stamp = datetime.fromtimestamp(record.created, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        extras = " ".join(f"{k}={v}" for k, v in fields_of(record).items())
        line = f"{stamp} {record.levelname:<7} {record.name}: {record.getMessage()}"
        if extras:
            line += f" [{extras}]"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        body: dict[str, object] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        body.update(fields_of(record))
        if record.exc_info:
            body["exception"] = self.formatException(record.exc_info)
        return json.dumps(body, default=str)


def configure_logging(fmt: str = "text", level: str = "INFO") -> None:
    """Send ``outbox_kafka`` logs to stderr in ``fmt`` ("text" or "json")."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger("outbox_kafka")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False
