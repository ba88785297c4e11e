"""Kept so that ``from outbox_kafka.http_server import ObservabilityServer`` goes on
working; the relay's HTTP endpoint lives in :mod:`outbox_kafka.relay.serve`."""

from __future__ import annotations

from outbox_kafka.relay.serve import HttpLimits, ObservabilityServer

__all__ = ["HttpLimits", "ObservabilityServer"]
