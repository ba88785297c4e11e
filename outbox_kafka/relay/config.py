"""The relay's settings: defaults, validation, and the librdkafka configuration they imply."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Literal

from outbox_kafka.database import NO_DATABASE_URL
from outbox_kafka.errors import ConfigurationError, EventError
from outbox_kafka.limits import DEFAULT_MAX_CLAIM_BYTES, KAFKA_MESSAGE_MAX_BYTES, KEY_PARTITIONERS
from outbox_kafka.naming import TableNames
from outbox_kafka.relay.lease import check_delivery_timeout
from outbox_kafka.topic_names import check_topic

KAFKA_ENV_PREFIX = "OUTBOX_KAFKA_CONFIG_"

#: Retention is given in days on the command line and in seconds everywhere else.
SECONDS_PER_DAY = 86400.0
#: librdkafka settings the relay's guarantees depend on; users cannot change them.
FORCED_KAFKA = {"enable.idempotence": "true", "acks": "all"}
_ACKS_ALIASES = {"acks", "request.required.acks"}
_TIMEOUT_KEYS = ("delivery.timeout.ms", "message.timeout.ms")
_MIN_MESSAGE_MAX_BYTES = 1000
#: Keys whose values are secrets: never logged, never shown.
SECRET_KAFKA_KEYS = frozenset(
    {
        "sasl.password",
        "sasl.username",
        "sasl.oauthbearer.client.secret",
        "sasl.oauthbearer.config",
        "ssl.key.password",
        "ssl.key.pem",
        "ssl.keystore.password",
        "ssl_key",
    }
)
COMPRESSIONS = ("none", "gzip", "snappy", "lz4", "zstd")
OnExhausted = Literal["continue", "park"]
OnUnproven = Literal["wait", "send"]


@dataclass(frozen=True)
class RelaySettings:
    """Everything the relay needs; see ``outbox-kafka relay --help`` for each field."""

    database_url: str = field(repr=False)  # may hold a password
    bootstrap_servers: str
    table: str = "outbox"
    db_schema: str = "public"
    kafka_config: Mapping[str, str] = field(default_factory=dict, repr=False)
    batch_size: int = 1000
    max_claim_bytes: int = DEFAULT_MAX_CLAIM_BYTES
    poll_interval: float = 0.5
    lease_seconds: float = 30.0
    delivery_timeout_ms: int = 10_000
    backoff_base: float = 0.5
    backoff_cap: float = 60.0
    max_attempts: int = 50
    compression: str = "none"
    dead_letter_topic: str | None = None
    on_exhausted: OnExhausted = "continue"
    on_unproven: OnUnproven = "wait"
    create_topics: int | None = None
    listen: bool = True
    shutdown_timeout: float = 30.0
    retain_delivered_seconds: float = 7 * SECONDS_PER_DAY
    retain_discarded_seconds: float = 90 * SECONDS_PER_DAY
    purge_interval: float = 300.0
    purge_batch: int = 1000
    sample_interval: float = 15.0
    relay_id: str = field(default_factory=lambda: f"{os.uname().nodename}-{os.getpid()}")

    def __post_init__(self) -> None:
        TableNames(self.table, self.db_schema)
        if not self.database_url:
            raise ConfigurationError(NO_DATABASE_URL)
        if not self.bootstrap_servers:
            raise ConfigurationError(
                "no Kafka bootstrap servers (--bootstrap-servers or OUTBOX_KAFKA_BOOTSTRAP_SERVERS)"
            )
        _positive("batch_size", self.batch_size)
        _positive("max_claim_bytes", self.max_claim_bytes)
        _positive("poll_interval", self.poll_interval)
        _positive("lease_seconds", self.lease_seconds)
        _positive("backoff_base", self.backoff_base)
        _positive("max_attempts", self.max_attempts)
        _positive("shutdown_timeout", self.shutdown_timeout)
        _positive("purge_batch", self.purge_batch)
        _positive("purge_interval", self.purge_interval)
        _positive("sample_interval", self.sample_interval)
        if self.backoff_cap < self.backoff_base:
            raise ConfigurationError(
                f"backoff_cap ({self.backoff_cap} s) is below backoff_base ({self.backoff_base} s)"
            )
        if self.compression not in COMPRESSIONS:
            raise ConfigurationError(
                f"compression {self.compression!r} is not one of {', '.join(COMPRESSIONS)}"
            )
        if self.on_exhausted not in ("continue", "park"):
            raise ConfigurationError(
                f"on_exhausted must be 'continue' or 'park', not {self.on_exhausted!r}"
            )
        if self.on_unproven not in ("wait", "send"):
            raise ConfigurationError(
                f"on_unproven must be 'wait' or 'send', not {self.on_unproven!r}"
            )
        if self.create_topics is not None:
            _positive("create_topics", self.create_topics)
        for key, value in self.kafka_config.items():
            if key in FORCED_KAFKA and str(value).lower() != FORCED_KAFKA[key]:
                raise ConfigurationError(
                    f"Kafka setting {key}={value} is not allowed: the relay needs "
                    f"{key}={FORCED_KAFKA[key]} for ordering and no loss"
                )
            if key in _ACKS_ALIASES and str(value).lower() not in {"all", "-1"}:
                raise ConfigurationError(
                    f"Kafka setting {key}={value} is not allowed: use acks=all"
                )
            if key == "partitioner" and str(value) not in KEY_PARTITIONERS:
                raise ConfigurationError(
                    f"Kafka setting partitioner={value} is not allowed: the relay needs "
                    f"{' or '.join(KEY_PARTITIONERS)}, so that every event of a key goes to "
                    "the same partition, the one a Java client would choose"
                )
        self._check_message_max_bytes()
        check_kafka_security(self.kafka_config)
        check_delivery_timeout(self.effective_delivery_timeout_ms, self.lease_seconds)
        if self.dead_letter_topic is not None:
            try:
                check_topic(self.dead_letter_topic)
            except EventError as exc:
                raise ConfigurationError(f"dead-letter topic: {exc.reason}") from None

    def _check_message_max_bytes(self) -> None:
        value = self.kafka_config.get("message.max.bytes")
        if value is None:
            return
        try:
            size = int(value)
        except ValueError:
            raise ConfigurationError(
                f"Kafka setting message.max.bytes={value!r} is not an integer"
            ) from None
        if size < _MIN_MESSAGE_MAX_BYTES:
            raise ConfigurationError(
                f"Kafka setting message.max.bytes={size} is too small: librdkafka's "
                f"minimum is {_MIN_MESSAGE_MAX_BYTES}"
            )

    @property
    def names(self) -> TableNames:
        return TableNames(self.table, self.db_schema)

    @property
    def effective_delivery_timeout_ms(self) -> int:
        for key in _TIMEOUT_KEYS:
            if key in self.kafka_config:
                try:
                    return int(self.kafka_config[key])
                except ValueError:
                    raise ConfigurationError(
                        f"Kafka setting {key}={self.kafka_config[key]!r} is not an integer"
                    ) from None
        return self.delivery_timeout_ms

    def producer_config(self) -> dict[str, str]:
        """The librdkafka configuration of the relay's producer."""
        config = {
            "bootstrap.servers": self.bootstrap_servers,
            "partitioner": "murmur2_random",
            "compression.type": self.compression,
            "linger.ms": "5",
            "message.max.bytes": str(KAFKA_MESSAGE_MAX_BYTES),
            "allow.auto.create.topics": "false",
            "queue.buffering.max.messages": str(max(100_000, self.batch_size * 4)),
            # Feeds the outbox_kafka_* gauges through the producer's stats_cb.
            "statistics.interval.ms": "15000",
        }
        config.update({k: str(v) for k, v in self.kafka_config.items()})
        for key in _TIMEOUT_KEYS:
            config.pop(key, None)
        config["delivery.timeout.ms"] = str(self.effective_delivery_timeout_ms)
        config.update(FORCED_KAFKA)
        return config

    def admin_config(self) -> dict[str, str]:
        """Connection settings (security included) for the admin client."""
        producer_only = {
            "partitioner",
            "compression.type",
            "linger.ms",
            "message.max.bytes",
            "queue.buffering.max.messages",
            "delivery.timeout.ms",
            "allow.auto.create.topics",
            "statistics.interval.ms",
            *FORCED_KAFKA,
        }
        return {k: v for k, v in self.producer_config().items() if k not in producer_only}

    def secret_values(self) -> list[str]:
        """The secret strings in these settings, for log scrubbing."""
        from outbox_kafka.database import url_secrets

        found = url_secrets(self.database_url)
        found.extend(str(v) for k, v in self.kafka_config.items() if is_secret_kafka_key(k) and v)
        return found

    def digest(self) -> str:
        """A short fingerprint of the settings, secrets excluded, for the info metric."""
        public = {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if f.name not in {"database_url", "kafka_config", "relay_id"}
        }
        public["kafka_config"] = {
            k: v for k, v in sorted(self.kafka_config.items()) if not is_secret_kafka_key(k)
        }
        blob = json.dumps(public, sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()[:12]


def is_secret_kafka_key(key: str) -> bool:
    """Whether a librdkafka setting holds a secret (also misspelt ones that look like it)."""
    lowered = key.lower()
    return lowered in SECRET_KAFKA_KEYS or any(
        word in lowered for word in ("password", "secret", "token", "key.pem", "credential")
    )


def redact_kafka_config(config: Mapping[str, object]) -> dict[str, object]:
    """``config`` with every secret value replaced by ``***`` (callbacks left out), for logs."""
    return {
        k: "***" if is_secret_kafka_key(k) else v
        for k, v in config.items()
        if isinstance(v, (str, int, float, bool))
    }


SECURITY_PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
SASL_MECHANISMS = ("GSSAPI", "PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "OAUTHBEARER")
#: TLS settings naming a file (or, for the CA, a directory) that must exist at start-up.
_TLS_FILES = (
    "ssl.ca.location",
    "ssl.certificate.location",
    "ssl.key.location",
    "ssl.keystore.location",
    "ssl.crl.location",
)
#: A client certificate and its private key come together, in either form.
_TLS_PAIRS = (
    ("ssl.certificate.location", "ssl.key.location"),
    ("ssl.certificate.pem", "ssl.key.pem"),
)


def check_kafka_security(config: Mapping[str, str]) -> None:
    """Refuse TLS and SASL settings that cannot work together, naming the setting.

    librdkafka takes every setting as given; this catches at start-up what it
    would otherwise report as a connection failure at the first send, or
    silently ignore (TLS files under a plaintext protocol). Secret values are
    never part of the message.
    """
    protocol_value = str(config.get("security.protocol", "PLAINTEXT"))
    protocol = protocol_value.upper()
    if protocol not in SECURITY_PROTOCOLS:
        raise ConfigurationError(
            f"Kafka setting security.protocol={protocol_value} is not one of "
            f"{', '.join(SECURITY_PROTOCOLS)}"
        )
    uses_sasl = protocol.startswith("SASL_")
    uses_tls = protocol in ("SSL", "SASL_SSL")
    mechanism_key = "sasl.mechanism" if "sasl.mechanism" in config else "sasl.mechanisms"
    # Settings that choose how to authenticate or what to trust are refused where the
    # protocol ignores them; a leftover password on its own changes nothing and passes.
    sasl_keys = sorted(k for k in config if k.startswith("sasl.") and not is_secret_kafka_key(k))
    if sasl_keys and not uses_sasl:
        raise ConfigurationError(
            f"Kafka setting {sasl_keys[0]} is set but security.protocol is {protocol}: "
            "SASL needs security.protocol=SASL_SSL (or SASL_PLAINTEXT)"
        )
    if uses_sasl:
        mechanism = str(config.get(mechanism_key, "GSSAPI")).upper()
        if mechanism not in SASL_MECHANISMS:
            raise ConfigurationError(
                f"Kafka setting {mechanism_key}={config.get(mechanism_key)} is not one of "
                f"{', '.join(SASL_MECHANISMS)}"
            )
        if mechanism in ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"):
            missing = [k for k in ("sasl.username", "sasl.password") if not config.get(k)]
            if missing:
                raise ConfigurationError(
                    f"security.protocol={protocol} with {mechanism_key}={mechanism} needs "
                    f"{' and '.join(missing)} (Kafka setting {missing[0]} is missing or empty)"
                )
    tls_keys = sorted(
        k
        for k in config
        if (k.startswith("ssl.") or k == "enable.ssl.certificate.verification")
        and not is_secret_kafka_key(k)
    )
    if tls_keys and not uses_tls:
        raise ConfigurationError(
            f"Kafka setting {tls_keys[0]} is set but security.protocol is {protocol}, which "
            "does not use TLS: use security.protocol=SSL (or SASL_SSL)"
        )
    for one, other in _TLS_PAIRS:
        if bool(config.get(one)) != bool(config.get(other)):
            given, absent = (one, other) if config.get(one) else (other, one)
            raise ConfigurationError(
                f"Kafka setting {given} is set without {absent}: a client certificate "
                "needs its private key and the key its certificate"
            )
    for key in _TLS_FILES:
        location = config.get(key)
        probe = key == "ssl.ca.location" and location == "probe"  # the system's CA store
        if location and not probe and not Path(location).exists():
            raise ConfigurationError(f"Kafka setting {key}: {location} does not exist")


def _positive(name: str, value: float) -> None:
    if value <= 0:
        raise ConfigurationError(f"{name} must be positive, got {value}")


def kafka_config_from_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """``OUTBOX_KAFKA_CONFIG_SASL_MECHANISM=PLAIN`` -> ``{"sasl.mechanism": "PLAIN"}``."""
    env = os.environ if environ is None else environ
    return {
        name[len(KAFKA_ENV_PREFIX) :].lower().replace("_", "."): value
        for name, value in env.items()
        if name.startswith(KAFKA_ENV_PREFIX) and len(name) > len(KAFKA_ENV_PREFIX)
    }


def parse_kafka_pair(pair: str) -> tuple[str, str]:
    """``"linger.ms=10"`` -> ``("linger.ms", "10")``."""
    key, sep, value = pair.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigurationError(f"Kafka setting {pair!r} is not of the form key=value")
    return key, value.strip()


def kafka_config_from_file(path: str | Path) -> dict[str, str]:
    """Read ``key=value`` lines (``#`` comments allowed), as in a Java properties file."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ConfigurationError(f"cannot read Kafka config file {path}: {exc}") from None
    config: dict[str, str] = {}
    for number, line in enumerate(lines, start=1):
        stripped = line.strip()
        if not stripped or stripped.startswith(("#", "!")):
            continue
        try:
            key, value = parse_kafka_pair(stripped)
        except ConfigurationError:
            # The line itself is not shown: it may hold a secret in another syntax.
            raise ConfigurationError(
                f"{path}:{number}: expected key=value (the line has no '=')"
            ) from None
        config[key] = value
    return config
