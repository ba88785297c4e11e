"""Kept so that ``from outbox_kafka.http_server import ObservabilityServer`` goes on
working; the relay's HTTP endpoint lives in :mod:`outbox_kafka.relay.http_server`."""

from __future__ import annotations

from outbox_kafka.relay.http_limits import HttpLimits
from outbox_kafka.relay.http_server import ObservabilityServer

__all__ = ["HttpLimits", "ObservabilityServer"]
