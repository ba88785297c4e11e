"""Kept so that ``from outbox_kafka.settings import RelaySettings`` goes on working; the
relay's settings live in :mod:`outbox_kafka.relay.config`."""

from __future__ import annotations

from outbox_kafka.relay.config import (
    RelaySettings,
    kafka_config_from_env,
    kafka_config_from_file,
)

__all__ = ["RelaySettings", "kafka_config_from_env", "kafka_config_from_file"]
