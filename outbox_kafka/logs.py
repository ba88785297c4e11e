"""Log set-up: one action per record, structured fields, text or JSON, secrets scrubbed.

Records carry their fields as ``extra={"action": ..., ...}``; the formatters
here print them after the message (text) or as keys (JSON). Every formatted
record passes through :func:`redact`, which masks the secret values registered
with :func:`register_secrets` (database passwords, SASL/TLS secrets), so a
secret quoted in a driver's error message does not reach the logs either.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
from collections.abc import Iterable
from datetime import UTC, datetime

from outbox_kafka.errors import ConfigurationError

LOG_FORMATS = ("text", "json")
MASK = "***"
LIBRDKAFKA_LOGGER = "outbox_kafka.librdkafka"

# Attributes every LogRecord has; anything else was passed through ``extra``.
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message",
    "asctime",
    "taskName",
}
# Shorter values would mask ordinary words everywhere; they are still kept out
# of every structured field (URLs are redacted by structure, not by value).
_MIN_SECRET_LENGTH = 4
_secrets: tuple[str, ...] = ()
_secrets_lock = threading.Lock()


def register_secrets(values: Iterable[str]) -> None:
    """Mask these values (and their JSON-escaped forms) in every formatted record."""
    global _secrets
    forms = set(_secrets)
    for value in values:
        if value and len(value) >= _MIN_SECRET_LENGTH:
            forms.add(value)
            forms.add(json.dumps(value)[1:-1])
    with _secrets_lock:
        # Longest first, so a secret containing another is masked whole.
        _secrets = tuple(sorted(forms, key=len, reverse=True))


def redact(text: str) -> str:
    """``text`` with every registered secret replaced by ``***``."""
    for secret in _secrets:
        if secret in text:
            text = text.replace(secret, MASK)
    return text


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
        return redact(line)


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, then the record's fields."""

    def format(self, record: logging.LogRecord) -> str:
        body: dict[str, object] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in fields_of(record).items():
            body.setdefault(key, value)
        if record.exc_info:
            body["exception"] = self.formatException(record.exc_info)
        return redact(json.dumps(body, default=str))


class _DefaultAction(logging.Filter):
    """Gives records from code that passes no ``extra`` (librdkafka) an action."""

    def __init__(self, action: str) -> None:
        super().__init__()
        self.action = action

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "action"):
            record.action = self.action
        return True


def librdkafka_logger() -> logging.Logger:
    """The logger librdkafka's messages go to (``logger`` in a client's configuration)."""
    logger = logging.getLogger(LIBRDKAFKA_LOGGER)
    if not any(isinstance(f, _DefaultAction) for f in logger.filters):
        logger.addFilter(_DefaultAction("librdkafka"))
    return logger


def configure_logging(fmt: str = "text", level: str = "INFO", secrets: Iterable[str] = ()) -> None:
    """Send ``outbox_kafka`` logs to stderr in ``fmt`` ("text" or "json").

    ``secrets`` are masked in every record from now on.
    """
    if fmt not in LOG_FORMATS:
        raise ConfigurationError(f"log format must be one of {', '.join(LOG_FORMATS)}, not {fmt!r}")
    register_secrets(secrets)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger("outbox_kafka")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False
