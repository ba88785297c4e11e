"""Moved: the producer's checks are in :mod:`outbox_kafka.producer.event_checks`, and
``check_topic`` in :mod:`outbox_kafka.topic_names`; this re-export goes when nothing
imports it."""

from __future__ import annotations

from outbox_kafka.topic_names import check_topic

__all__ = ["check_topic"]
