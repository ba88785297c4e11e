"""One metrics endpoint for several outboxes: each outbox's metrics with an ``outbox`` label.

Each relay loop of a multi-outbox relay keeps its own
:class:`~outbox_kafka.relay.metrics.RelayMetrics` on a registry of its own;
this collector serves them all as one set of metric families, every sample
labelled with the name of the outbox it counts.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

#: The label that names the outbox of a sample.
OUTBOX_LABEL = "outbox"


class OutboxLabelledMetrics(Collector):
    """Collects several registries as one, adding ``outbox="<name>"`` to every sample."""

    def __init__(self, registries: Mapping[str, CollectorRegistry]) -> None:
        self._registries = dict(registries)

    def collect(self) -> Iterable[Metric]:
        merged: dict[str, Metric] = {}
        for outbox, registry in self._registries.items():
            for family in registry.collect():
                target = merged.get(family.name)
                if target is None:
                    target = merged[family.name] = Metric(
                        family.name, family.documentation, family.type, family.unit
                    )
                for sample in family.samples:
                    target.samples.append(
                        sample._replace(labels={OUTBOX_LABEL: outbox, **sample.labels})
                    )
        return merged.values()

    def describe(self) -> Iterable[Metric]:
        return []


def outbox_labelled_registry(registries: Mapping[str, CollectorRegistry]) -> CollectorRegistry:
    """A registry to serve: the outboxes' registries as one, labelled by outbox."""
    served = CollectorRegistry(auto_describe=False)
    served.register(OutboxLabelledMetrics(registries))
    return served
