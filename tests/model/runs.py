"""How many sequences the model checkers try, and how: from the environment
(``OUTBOX_MODEL_EXAMPLES``, ``OUTBOX_MODEL_STEPS``, ``OUTBOX_MODEL_RANDOM=1`` for fresh
random sequences instead of the same ones every run)."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings


def model_settings() -> settings:
    return settings(
        max_examples=int(os.environ.get("OUTBOX_MODEL_EXAMPLES", "60")),
        stateful_step_count=int(os.environ.get("OUTBOX_MODEL_STEPS", "40")),
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        derandomize=os.environ.get("OUTBOX_MODEL_RANDOM") != "1",
    )
