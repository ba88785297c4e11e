"""Sequences the model checker shrank to, kept as regression tests: each one
failed on the relay as it was before the fix named in its docstring."""

from __future__ import annotations

from tests.model.test_relay_model import RelayModel


def _run(steps: list[tuple[str, dict[str, object]]]) -> None:
    state = RelayModel()
    try:
        for name, arguments in steps:
            getattr(state, name)(**arguments)
            state.promises_hold()
    finally:
        state.teardown()


def test_an_innocent_event_in_a_refused_record_batch_is_not_discarded() -> None:
    """Errors a broker gives a whole record batch were classed permanent for each
    of its messages: key a's second event was discarded with its poisoned first."""
    _run(
        [
            ("write", {"delay": 0.0, "key": "a", "padding": 0, "poisoned": True, "topic": "t1"}),
            ("write", {"delay": 0.0, "key": "a", "padding": 0, "poisoned": False, "topic": "t1"}),
            ("relay_cycles", {"cycles": 1, "index": 0}),
        ]
    )


def test_a_key_with_a_message_in_the_producer_waits_behind_a_retried_one() -> None:
    """A key whose retried event had a later one still unreported came due after
    the short backoff, and was sent while that message could still land."""
    _run(
        [
            ("weather", {"topic": "t1", "weather": "transient"}),
            ("write", {"delay": 0.0, "key": "c", "padding": 0, "poisoned": False, "topic": "t1"}),
            ("relays_stop_waiting_for_reports_early", {"cut_short": True}),
            ("write", {"delay": 0.0, "key": "c", "padding": 0, "poisoned": False, "topic": "t1"}),
            ("relay_cycles", {"cycles": 1, "index": 0}),
            ("time_passes", {"seconds": 0.5}),
            ("relay_drains", {"index": 0}),
        ]
    )


def test_a_relay_stopped_while_it_cannot_record_ends_cleanly() -> None:
    """With nothing sent (its topic missing), a record failing at the shutdown
    deadline raised out of the relay's drain."""
    _run(
        [
            ("weather", {"topic": "t1", "weather": "missing"}),
            ("write", {"delay": 0.0, "key": "a", "padding": 0, "poisoned": False, "topic": "t1"}),
            ("relay_stops_while_the_database_is_down", {"index": 1}),
        ]
    )


def test_retention_does_not_renumber_a_key_with_an_event_left() -> None:
    """The in-memory store numbered a new event from the last event retention left,
    one the key had already passed: it was never sent."""
    _run(
        [
            ("write", {"delay": 0.0, "key": "a", "padding": 0, "poisoned": True, "topic": "t1"}),
            ("write", {"delay": 0.0, "key": "a", "padding": 0, "poisoned": False, "topic": "t1"}),
            ("relay_drains", {"index": 0}),
            ("retention_purges_what_is_done", {}),
            ("write", {"delay": 0.0, "key": "a", "padding": 0, "poisoned": False, "topic": "t1"}),
        ]
    )


def test_a_key_left_out_by_the_byte_budget_is_not_overtaken_again_and_again() -> None:
    """A key the budget left out went back due at the record's time, as late as the
    hot key it waited behind, and lost to it by name at every claim."""
    small = {"delay": 0.0, "padding": 0, "poisoned": False, "topic": "t1"}
    large = {**small, "padding": 2500}
    _run(
        [
            ("configure", {"batch_size": 4, "max_claim_bytes": 2000, "on_exhausted": "continue"}),
            ("write", {**small, "key": "a"}),
            ("write", {**small, "key": "a"}),
            ("write", {**large, "key": "a"}),
            ("write", {**large, "key": "a"}),
            *[("write", {**small, "key": "a"}) for _ in range(9)],
            ("write", {**large, "key": "b"}),
            ("write", {**small, "key": "c"}),
            ("write", {**large, "key": "b"}),
        ]
    )


def test_a_requeue_does_not_cut_short_the_wait_for_a_message_that_may_land() -> None:
    """A requeue made a key due at once while the relay held it for a message that
    had no delivery report yet: the key was sent again while that message could land."""
    event = {"delay": 0.0, "key": "a", "padding": 0, "topic": "t1"}
    _run(
        [
            ("configure", {"batch_size": 2, "max_claim_bytes": 2000, "on_exhausted": "continue"}),
            ("write", {**event, "poisoned": True}),
            ("weather", {"topic": "t1", "weather": "unreported"}),
            ("write", {**event, "poisoned": False}),
            ("relay_cycles", {"cycles": 2, "index": 0}),
            ("operator_requeues_a_discarded_event", {"pick": 0}),
            ("relay_stops_while_the_database_is_down", {"index": 0}),
        ]
    )


def test_a_key_with_a_message_in_the_producer_is_not_claimable_behind_a_retried_one() -> None:
    """The retried-key branch ran before the check for unreported messages: key a
    was handed back after its retry's backoff (0.2 s) while its later message could
    still land (24 s), and only a send within that window showed it."""
    _run(
        [
            ("configure", {"batch_size": 2, "max_claim_bytes": 2000, "on_exhausted": "continue"}),
            ("relays_stop_waiting_for_reports_early", {"cut_short": True}),
            ("weather", {"topic": "t1", "weather": "transient"}),
            ("writers_commit_at_once", {"keys": ["a", "a"], "padding": 0, "topic": "t1"}),
            ("relay_drains", {"index": 0}),
        ]
    )


def test_a_relay_whose_record_failed_at_shutdown_sends_no_further_batch() -> None:
    """A drain went on after a record failed for good at shutdown and sent the batch
    read ahead: three batches of one relay loop sent and never recorded."""
    _run(
        [
            ("configure", {"batch_size": 2, "max_claim_bytes": 2000, "on_exhausted": "continue"}),
            ("writers_commit_at_once", {"keys": ["a", "a", "c", "c"], "padding": 0, "topic": "t1"}),
            ("relay_cycles", {"cycles": 1, "index": 0}),
            ("writers_commit_at_once", {"keys": ["a", "b"], "padding": 0, "topic": "t1"}),
            ("relay_stops_while_the_database_is_down", {"index": 0}),
        ]
    )
