"""Operator actions on an outbox: stats, requeue, unpark, purge and set-up checks.

Each action runs in its own short transaction; the relay picks the result up
on its next claim. These are the functions behind ``outbox-kafka stats``,
``requeue``, ``unpark``, ``purge`` and ``check``; driver errors are translated
into :class:`~outbox_kafka.errors.StorageError`.
"""

from __future__ import annotations

from outbox_kafka.database import short_command_engine

from .consistency import CONSISTENCY_CHECKS, ConsistencyReport, Violation, check_consistency
from .diagnosis import (
    CheckResult,
    PendingTopics,
    check_database,
    check_kafka,
    check_schemas,
    pending_topics,
)
from .events import DiscardedEvent, ParkedKey
from .log_check import check_log_mode, log_pending_topics
from .purge import (
    DEFAULT_PURGE_BATCH,
    DEFAULT_RETAIN_DELIVERED_SECONDS,
    DEFAULT_RETAIN_DISCARDED_SECONDS,
    PurgeResult,
    purge,
)
from .requeue import RequeueResult, UnparkResult, requeue, requeue_events, unpark, unpark_keys
from .selection import Selection
from .stats import OutboxStats, TopicCounts, outbox_stats, remaining_work

__all__ = [
    "CONSISTENCY_CHECKS",
    "DEFAULT_PURGE_BATCH",
    "DEFAULT_RETAIN_DELIVERED_SECONDS",
    "DEFAULT_RETAIN_DISCARDED_SECONDS",
    "CheckResult",
    "ConsistencyReport",
    "DiscardedEvent",
    "OutboxStats",
    "ParkedKey",
    "PendingTopics",
    "PurgeResult",
    "RequeueResult",
    "Selection",
    "TopicCounts",
    "UnparkResult",
    "Violation",
    "check_consistency",
    "check_database",
    "check_kafka",
    "check_log_mode",
    "check_schemas",
    "log_pending_topics",
    "outbox_stats",
    "pending_topics",
    "purge",
    "remaining_work",
    "requeue",
    "requeue_events",
    "short_command_engine",
    "unpark",
    "unpark_keys",
]
