"""The relay: claims committed events, publishes them to Kafka in per-key order, and
records what Kafka acknowledged. Start it with ``outbox-kafka relay`` or
``Relay(RelaySettings(...)).run()``; the loop's internals are not public API."""

from __future__ import annotations

from outbox_kafka.relay.loop import Relay
from outbox_kafka.relay.metrics import RelayMetrics
from outbox_kafka.relay.reports import CycleReport, DrainResult

__all__ = ["CycleReport", "DrainResult", "Relay", "RelayMetrics"]
