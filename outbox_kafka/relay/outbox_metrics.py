"""One metrics endpoint for several outboxes: each outbox's metrics with an ``outbox`` label.

Each relay loop of a multi-outbox relay keeps its own
:class:`~outbox_kafka.relay.metrics.RelayMetrics` on a registry of its own;
this collector serves them all as one set of metric families, every sample
labelled with the name of the outbox it counts. The shared producer's gauges
are served once, without the label.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

#: The label that names the outbox of a sample.
OUTBOX_LABEL = "outbox"


class OutboxLabelledMetrics(Collector):
    """Collects several registries as one, adding ``outbox="<name>"`` to every sample.

    ``shared``: the metrics of what every outbox shares (the one producer),
    served as they are, without an ``outbox`` label: repeated under each
    outbox they would read as per-outbox values, and a sum over outboxes
    would count them once per outbox.
    """

    def __init__(
        self,
        registries: Mapping[str, CollectorRegistry],
        shared: CollectorRegistry | None = None,
    ) -> None:
        self._registries = dict(registries)
        self._shared = shared

    def collect(self) -> Iterable[Metric]:
        merged: dict[str, Metric] = {}
        if self._shared is not None:
            for family in self._shared.collect():
                merged[family.name] = family
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


def outbox_labelled_registry(
    registries: Mapping[str, CollectorRegistry], shared: CollectorRegistry | None = None
) -> CollectorRegistry:
    """A registry to serve: the outboxes' registries as one, labelled by outbox,
    and the ``shared`` registry's metrics once, unlabelled."""
    served = CollectorRegistry(auto_describe=False)
    served.register(OutboxLabelledMetrics(registries, shared))
    return served
