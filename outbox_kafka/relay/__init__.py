"""The relay: claims committed events, publishes them to Kafka in per-key order, and
records what Kafka acknowledged. Start it with ``outbox-kafka relay`` or
``Relay(RelaySettings(...)).run()``; the loop's internals are not public API.

One event's walk, module by module: :mod:`~outbox_kafka.relay.claim` (the claim and
the checks), :mod:`~outbox_kafka.relay.decide` (what to send, and what becomes of
each event), :mod:`~outbox_kafka.relay.send` (the send under the
lease, the producer and its delivery reports), :mod:`~outbox_kafka.relay.store` (the
fenced record), all driven by :mod:`~outbox_kafka.relay.loop` under the rules of
:mod:`~outbox_kafka.relay.lease`."""

from __future__ import annotations

from outbox_kafka.relay.batch import CycleReport, DrainResult, Remaining
from outbox_kafka.relay.config import RelaySettings
from outbox_kafka.relay.loop import Relay
from outbox_kafka.relay.metrics import RelayMetrics

__all__ = ["CycleReport", "DrainResult", "Relay", "RelayMetrics", "RelaySettings", "Remaining"]
