"""Retention: the relay's purge task. When to purge next, and one purge through the
store (:func:`outbox_kafka.purging.purge_old_events`, shared with ``outbox-kafka purge``)."""

from __future__ import annotations

import logging
import random
from typing import TYPE_CHECKING

from outbox_kafka.errors import StorageError

if TYPE_CHECKING:
    from outbox_kafka.relay.config import RelaySettings
    from outbox_kafka.relay.observe import RelayObserver
    from outbox_kafka.relay.ports import ClaimStore

#: The purge task logs as part of the relay, as its other steps do.
relay_log = logging.getLogger("outbox_kafka.relay")


class Retention:
    """The relay's purge task: when to purge next, and one purge."""

    def __init__(
        self,
        store: ClaimStore,
        settings: RelaySettings,
        observer: RelayObserver,
        rng: random.Random,
    ) -> None:
        self._store = store
        self._settings = settings
        self._observer = observer
        self._rng = rng
        self._first = True

    def delay(self) -> float:
        """Seconds to the next purge: spread relays' purges apart; the first comes soon."""
        if self._first:
            self._first = False
            return min(self._settings.purge_interval, 10.0) * self._rng.random()
        return self._settings.purge_interval

    def run_once(self) -> None:
        """Delete delivered and discarded events past their retention, in bounded batches."""
        settings = self._settings
        try:
            removed = self._store.purge(
                delivered_seconds=settings.retain_delivered_seconds,
                discarded_seconds=settings.retain_discarded_seconds,
                batch=settings.purge_batch,
            )
        except StorageError as exc:
            self._observer.purge_failed(exc)
            return
        if removed:
            self._observer.purge_done(removed)
