"""The producer's Prometheus metrics: ``outbox_enqueue_failures_total``, by reason."""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from collections.abc import Awaitable, Callable
from typing import Concatenate, ParamSpec, Protocol, TypeVar

from prometheus_client import REGISTRY, CollectorRegistry, Counter
from sqlalchemy.exc import SQLAlchemyError

from outbox_kafka.errors import DuplicateEventId, EventError, UnsafeConnection

#: Every ``reason`` of ``outbox_enqueue_failures_total``; all start at 0.
ENQUEUE_FAILURE_REASONS = (
    "validation",
    "duplicate_event_id",
    "unsafe_connection",
    "database",
    "other",
)


def enqueue_failure_reason(exc: BaseException) -> str:
    """The ``reason`` label for an exception raised by ``enqueue``/``enqueue_many``."""
    if isinstance(exc, DuplicateEventId):
        return "duplicate_event_id"
    if isinstance(exc, EventError):
        return "validation"
    if isinstance(exc, UnsafeConnection):
        return "unsafe_connection"
    if isinstance(exc, SQLAlchemyError):
        return "database"
    return "other"


class ProducerMetrics:
    """The producer side's metrics; one instance per registry (see :func:`producer_metrics`)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.enqueue_failures = Counter(
            "outbox_enqueue_failures",
            "enqueue/enqueue_many calls that raised, by kind of error.",
            ["reason"],
            registry=registry,
        )
        for reason in ENQUEUE_FAILURE_REASONS:
            self.enqueue_failures.labels(reason=reason)

    def enqueue_failed(self, exc: BaseException, reason: str | None = None) -> None:
        """Count ``exc``; ``reason``: its label where :func:`enqueue_failure_reason` cannot tell
        (a database error that is not SQLAlchemy's)."""
        # enqueue may call enqueue_many: count each exception once, at the innermost call.
        if getattr(exc, "_outbox_counted", False):
            return
        with contextlib.suppress(AttributeError):
            exc._outbox_counted = True  # type: ignore[attr-defined]
        self.enqueue_failures.labels(reason=reason or enqueue_failure_reason(exc)).inc()


_producer_metrics: weakref.WeakKeyDictionary[CollectorRegistry, ProducerMetrics] = (
    weakref.WeakKeyDictionary()
)
_producer_metrics_lock = threading.Lock()


def producer_metrics(registry: CollectorRegistry | None = None) -> ProducerMetrics:
    """The producer metrics on ``registry`` (default: prometheus_client's global one).

    Every ``Outbox`` on one registry shares one set of metrics, since a
    registry refuses a metric name twice.
    """
    target = REGISTRY if registry is None else registry
    with _producer_metrics_lock:
        found = _producer_metrics.get(target)
        if found is None:
            found = _producer_metrics[target] = ProducerMetrics(target)
        return found


class _CountsEnqueueFailures(Protocol):
    producer_metrics: ProducerMetrics


S = TypeVar("S", bound=_CountsEnqueueFailures)
P = ParamSpec("P")
R = TypeVar("R")


def counts_enqueue_failures(
    method: Callable[Concatenate[S, P], R],
) -> Callable[Concatenate[S, P], R]:
    """Count the exceptions ``method`` raises in ``outbox_enqueue_failures_total``.

    The success path pays one extra call and nothing else.
    """

    @functools.wraps(method)
    def counted(self: S, /, *args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return method(self, *args, **kwargs)
        except Exception as exc:
            self.producer_metrics.enqueue_failed(exc)
            raise

    return counted


def counts_async_enqueue_failures(
    method: Callable[Concatenate[S, P], Awaitable[R]],
) -> Callable[Concatenate[S, P], Awaitable[R]]:
    """:func:`counts_enqueue_failures` for a coroutine method."""

    @functools.wraps(method)
    async def counted(self: S, /, *args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return await method(self, *args, **kwargs)
        except Exception as exc:
            self.producer_metrics.enqueue_failed(exc)
            raise

    return counted
