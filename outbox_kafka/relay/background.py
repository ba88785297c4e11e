"""Supervised background loops: the relay's side threads (retention, the backlog
sampler) never end silently. An unexpected error in a step is logged with its
traceback and counted in ``outbox_background_errors``; the loop goes on."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from outbox_kafka.relay.metrics import RelayMetrics

log = logging.getLogger("outbox_kafka.relay")


class SupervisedLoop:
    """Runs ``step`` in a daemon thread, waiting ``delay()`` seconds before each
    run, until :meth:`stop` (or ``stop_event``) is set."""

    def __init__(
        self,
        name: str,
        step: Callable[[], object],
        delay: Callable[[], float],
        metrics: RelayMetrics,
        *,
        stop_event: threading.Event | None = None,
    ) -> None:
        self.name = name
        self._step = step
        self._delay = delay
        self._metrics = metrics
        self._stop = stop_event or threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"outbox-{name}", daemon=True)

    def start(self) -> SupervisedLoop:
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Ask the loop to end and wait up to ``timeout`` seconds for its step to finish."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        while not self._stop.wait(self._delay()):
            self.run_step()

    def run_step(self) -> None:
        """Run one step now; an error is logged and counted, never raised."""
        try:
            self._step()
        except Exception as exc:
            self._metrics.background_errors.labels(task=self.name).inc()
            log.exception(
                "background task failed; it runs again at its next interval",
                extra={"action": "background_error", "task": self.name, "error": str(exc)},
            )
