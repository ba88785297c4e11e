"""Log records: text or JSON, one action and its fields per record, no secret ever printed."""

from __future__ import annotations

import io
import json
import logging
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from outbox_kafka import ConfigurationError
from outbox_kafka.database import redact_url, url_secrets
from outbox_kafka.logs import (
    JsonFormatter,
    TextFormatter,
    configure_logging,
    librdkafka_logger,
    redact,
    register_secrets,
)
from outbox_kafka.relay.config import (
    RelaySettings,
    is_secret_kafka_key,
    kafka_config_from_file,
    redact_kafka_config,
)


def _secret() -> str:
    return f"pw-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def captured() -> Iterator[tuple[logging.Logger, io.StringIO, logging.Handler]]:
    """A logger under ``outbox_kafka`` writing to a buffer; the formatter is set per test."""
    buffer = io.StringIO()
    handler = logging.StreamHandler(buffer)
    logger = logging.getLogger(f"outbox_kafka.test.{uuid.uuid4().hex[:6]}")
    logger.handlers[:] = [handler]
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    yield logger, buffer, handler
    logger.handlers.clear()


def test_json_records_parse_and_carry_the_action_and_its_fields(
    captured: tuple[logging.Logger, io.StringIO, logging.Handler],
) -> None:
    logger, buffer, handler = captured
    handler.setFormatter(JsonFormatter())
    event_id = str(uuid.uuid4())
    logger.warning(
        "send failed, will retry",
        extra={
            "action": "retry",
            "event_id": event_id,
            "key": "o-1",
            "topic": "orders",
            "attempt": 3,
            "error": "NO_REPORT: x",
        },
    )
    logger.info("plain", extra={"action": "start", "when": uuid.UUID(int=1)})
    first, second = (json.loads(line) for line in buffer.getvalue().splitlines())
    assert first["message"] == "send failed, will retry"
    assert first["level"] == "warning"
    assert first["logger"] == logger.name
    assert (first["action"], first["event_id"], first["key"], first["topic"]) == (
        "retry",
        event_id,
        "o-1",
        "orders",
    )
    assert first["attempt"] == 3
    assert first["time"].endswith("+00:00")
    # Values JSON cannot hold are written as text, not dropped.
    assert second["when"] == str(uuid.UUID(int=1))


def test_json_records_keep_their_own_keys_when_a_field_has_the_same_name(
    captured: tuple[logging.Logger, io.StringIO, logging.Handler],
) -> None:
    logger, buffer, handler = captured
    handler.setFormatter(JsonFormatter())
    logger.error("boom", extra={"action": "x", "level": "fake", "logger": "fake"})
    record = json.loads(buffer.getvalue())
    assert record["level"] == "error" and record["logger"] == logger.name


def test_text_records_show_the_fields_after_the_message(
    captured: tuple[logging.Logger, io.StringIO, logging.Handler],
) -> None:
    logger, buffer, handler = captured
    handler.setFormatter(TextFormatter())
    logger.error("event discarded", extra={"action": "discard", "key": "k", "attempt": 2})
    line = buffer.getvalue().strip()
    assert " ERROR " in line and "event discarded" in line
    assert line.endswith("[action=discard key=k attempt=2]")


def test_exceptions_stay_inside_one_json_record(
    captured: tuple[logging.Logger, io.StringIO, logging.Handler],
) -> None:
    logger, buffer, handler = captured
    handler.setFormatter(JsonFormatter())
    try:
        raise RuntimeError("line one\nline two")
    except RuntimeError:
        logger.exception("failed", extra={"action": "x"})
    lines = buffer.getvalue().splitlines()
    assert len(lines) == 1
    assert "line two" in json.loads(lines[0])["exception"]


@pytest.mark.parametrize("formatter", [TextFormatter(), JsonFormatter()])
def test_registered_secrets_never_reach_a_record(
    captured: tuple[logging.Logger, io.StringIO, logging.Handler], formatter: logging.Formatter
) -> None:
    logger, buffer, handler = captured
    handler.setFormatter(formatter)
    plain, quoted = _secret(), f'q"uo\\te-{uuid.uuid4().hex[:6]}-é'
    register_secrets([plain, quoted])
    logger.warning(
        f"driver said: password {plain} rejected",
        extra={"action": "db_retry", "error": f"auth failed for {quoted}", "url": plain},
    )
    out = buffer.getvalue()
    assert plain not in out
    assert quoted not in out and json.dumps(quoted)[1:-1] not in out
    assert "***" in out


def test_very_short_secrets_do_not_mask_ordinary_text() -> None:
    register_secrets(["ab"])
    assert redact("abc ab") == "abc ab"


def test_librdkafka_messages_get_an_action(
    captured: tuple[logging.Logger, io.StringIO, logging.Handler],
) -> None:
    _, buffer, handler = captured
    handler.setFormatter(JsonFormatter())
    kafka = librdkafka_logger()
    assert kafka.name.startswith("outbox_kafka.")
    kafka.handlers[:] = [handler]
    kafka.propagate = False
    try:
        # The shape confluent-kafka uses when it forwards librdkafka's log lines.
        kafka.log(logging.ERROR, "%s [%s] %s", "FAIL", "rdkafka#producer-1", "connect failed")
    finally:
        kafka.handlers.clear()
        kafka.propagate = True
    record = json.loads(buffer.getvalue())
    assert record["action"] == "librdkafka"
    assert record["message"] == "FAIL [rdkafka#producer-1] connect failed"
    assert len(librdkafka_logger().filters) == 1


def test_configure_logging_refuses_an_unknown_format() -> None:
    with pytest.raises(ConfigurationError, match="log format"):
        configure_logging("xml")


# --------------------------------------------------------------------------- redaction helpers


def test_redact_url_hides_passwords_also_in_the_query_string() -> None:
    url = "postgresql://relay:hunter2x@db/app?sslmode=require&password=hunter3x&sslpassword=h4x0r"
    shown = redact_url(url)
    for secret in ("hunter2x", "hunter3x", "h4x0r"):
        assert secret not in shown
    assert "relay:***@db/app" in shown and "sslmode=require" in shown


def test_url_secrets_lists_the_password_decoded_and_encoded() -> None:
    assert url_secrets("postgresql://u:p%40ss@h/d?password=xyz1") == ["p@ss", "xyz1", "p%40ss"]
    assert url_secrets("postgresql://u@/d?host=/tmp") == []


def test_kafka_config_redaction_hides_every_secret_value() -> None:
    config = {
        "bootstrap.servers": "k:9092",
        "sasl.password": "s1",
        "ssl.key.password": "s2",
        "ssl.keystore.password": "s3",
        "sasl.oauthbearer.client.secret": "s4",
        "ssl.key.pem": "s5",
        "SSL.Truststore.Password": "s6",  # not in the list, still a secret
        "stats_cb": print,
    }
    shown = redact_kafka_config(config)
    assert shown["bootstrap.servers"] == "k:9092"
    assert all(shown[k] == "***" for k in config if k.lower().startswith(("sasl", "ssl")))
    assert "stats_cb" not in shown
    assert not is_secret_kafka_key("security.protocol")


def test_settings_repr_and_digest_hold_no_secret() -> None:
    password, sasl = _secret(), _secret()
    settings = RelaySettings(
        database_url=f"postgresql://relay:{password}@db/app",
        bootstrap_servers="k:9092",
        kafka_config={"sasl.password": sasl, "security.protocol": "SASL_SSL"},
    )
    assert password not in repr(settings) and sasl not in repr(settings)
    assert set(settings.secret_values()) >= {password, sasl}
    other = RelaySettings(
        database_url="postgresql://relay:other@db/app",
        bootstrap_servers="k:9092",
        kafka_config={"sasl.password": "other", "security.protocol": "SASL_SSL"},
    )
    assert settings.digest() == other.digest()


def test_a_malformed_kafka_config_line_is_not_echoed(tmp_path: Path) -> None:
    secret = _secret()
    path = tmp_path / "kafka.properties"
    path.write_text(f"bootstrap.servers=k:9092\nsasl.password: {secret}\n")
    with pytest.raises(ConfigurationError) as caught:
        kafka_config_from_file(path)
    assert f"{path}:2" in str(caught.value)
    assert secret not in str(caught.value)
