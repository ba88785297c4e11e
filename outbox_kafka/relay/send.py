"""Sending one claimed batch under its lease, and acting on the decisions.

The events go out in one send together with the dead-letter copies of events
already known to be discarded; copies of events the broker's answers discarded
follow in a second send. Nothing is sent with less than one delivery timeout of
the lease left (:mod:`~outbox_kafka.relay.lease`), so all of it is delivered or
timed out before another relay can take the keys. The decisions
(:mod:`~outbox_kafka.relay.decide`) are pure; here they are announced to the
relay's observers (:mod:`~outbox_kafka.relay.observe`), which log and count them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from outbox_kafka.relay.batch import Claim, EventOutcome, KeyOutcome, Problem, Verdict
from outbox_kafka.relay.claim import Claimed
from outbox_kafka.relay.decide import RetryPolicy, dead_letter_messages, note_copies, plan_batch
from outbox_kafka.relay.lease import Lease
from outbox_kafka.relay.observe import RelayObserver
from outbox_kafka.relay.ports import Delivery, Message, MessagePublisher


@dataclass
class SentBatch:
    """A batch after sending: every key's and event's next state, to be recorded."""

    keys: list[KeyOutcome] = field(default_factory=list)
    events: list[EventOutcome] = field(default_factory=list)
    #: Events handed to the producer (dead-letter copies not counted).
    sent: int = 0


class BatchSender:
    def __init__(
        self,
        publisher: MessagePublisher,
        policy: RetryPolicy,
        observer: RelayObserver,
        *,
        dead_letter_topic: str | None,
        lease: Lease,
        abort: Callable[[], bool],
    ) -> None:
        self.publisher = publisher
        self.policy = policy
        self.observer = observer
        self.dead_letter_topic = dead_letter_topic
        self._lease = lease
        self._send_timeout = lease.delivery_timeout + 5.0
        self._abort = abort

    def send_claimed(self, claimed: Claimed) -> tuple[Claim, SentBatch]:
        """The send step of a cycle: send a claimed batch within its lease, timed; its
        outcome is decided but not yet recorded."""
        claim = claimed.claim
        if not claim.keys:
            return claim, SentBatch()
        started = time.monotonic()
        sent = self.send(claim, claimed.problems, self._lease.ends(claimed.asked_at))
        self.observer.sent(claim, time.monotonic() - started)
        return claim, sent

    def send(self, claim: Claim, problems: dict[int, Problem], lease_ends: float) -> SentBatch:
        """Send the claimed events; decide every key's and event's next state."""
        topic_problem = self.publisher.topic_problem
        message_limit = self.publisher.message_limit
        plan = plan_batch(claim, problems, topic_problem, self.policy, message_limit)
        results = plan.results
        first = plan.discarded_first
        first_copies = dead_letter_messages(
            first, self.dead_letter_topic, topic_problem, results.copies, message_limit
        )
        if plan.messages or first_copies:
            deliveries = self._send(plan.messages + first_copies, lease_ends)
            sent = deliveries[: len(plan.messages)]
            results.deliveries = {id(e): d for e, d in zip(plan.events, sent, strict=True)}
            note_copies(first, first_copies, deliveries[len(plan.messages) :], results.copies)

        # One walk per key decides both its next state and the dead-letter copies
        # the broker's answers call for; a key that needs copies is walked again
        # once they are answered.
        limit = claim.per_key_limit
        settlements = [
            self.policy.settle(claimed, due, results, limit, copy_unknown=None)
            for claimed, due in plan.keys
        ]
        later = [discard for settled in settlements for discard in settled.copies_to_send]
        if later:
            later_copies = dead_letter_messages(
                later, self.dead_letter_topic, topic_problem, results.copies, message_limit
            )
            if later_copies:
                note_copies(
                    later, later_copies, self._send(later_copies, lease_ends), results.copies
                )
            settlements = [
                self.policy.settle(claimed, due, results, limit)
                if settled.copies_to_send
                else settled
                for (claimed, due), settled in zip(plan.keys, settlements, strict=True)
            ]

        handed = sum(1 for delivery in results.deliveries.values() if delivery.sent)
        batch = SentBatch(keys=plan.idle_keys, sent=handed)
        for settled in settlements:
            batch.keys.append(settled.key)
            batch.events.extend(settled.events)
            self.observer.settled(settled)
        return batch

    def _send(self, messages: list[Message], lease_ends: float) -> list[Delivery]:
        """Send ``messages`` within the lease; those the broker refused with their
        record batch are sent again alone (:meth:`_resend_alone`)."""
        return self._resend_alone(messages, self._within_lease(messages, lease_ends), lease_ends)

    def _resend_alone(
        self, messages: list[Message], deliveries: list[Delivery], lease_ends: float
    ) -> list[Delivery]:
        """``deliveries`` with each message the broker refused with its record batch
        sent again on its own, in its key's order, so that only a message refused
        alone is found at fault.

        A message whose producer was reset under it (some brokers fence the producer
        of a refused batch) is sent alone once more on the new producer. A key stops
        at its first message that does not get through alone, and is not
        resent at all where a later message of it got through already (sent now,
        the refused one would land after it; it stays unsent and the order violation
        is counted). What stays refused is left unsent: tried again in a later batch,
        no attempt counted.
        """
        refused = [i for i, d in enumerate(deliveries) if d.verdict == Verdict.BATCH_REJECTED]
        if not refused:
            return deliveries
        self.observer.sending_alone(len(refused))
        out = list(deliveries)
        stopped = {
            messages[i].key
            for i in refused
            for j in range(i + 1, len(messages))
            if messages[j].key == messages[i].key and deliveries[j].verdict == Verdict.DELIVERED
        }
        for i in refused:
            message = messages[i]
            if message.key in stopped or self._abort():
                continue
            (delivery,) = self._within_lease([message], lease_ends)
            if delivery.reported and delivery.verdict == Verdict.RESET and not self._abort():
                # Some brokers fence the producer that sent a refused batch: the
                # message goes alone once more, on the producer built after it.
                (delivery,) = self._within_lease([message], lease_ends)
            if delivery.reported and delivery.verdict == Verdict.BATCH_REJECTED:
                delivery.verdict = Verdict.PERMANENT
                delivery.error = f"{delivery.error} (refused when sent alone)"
            out[i] = delivery
            if delivery.verdict != Verdict.DELIVERED or not delivery.reported:
                stopped.add(message.key)
        return out

    def _within_lease(self, messages: list[Message], lease_ends: float) -> list[Delivery]:
        """Send ``messages`` if the lease outlasts their delivery timeout; else none (unsent).

        Metadata lookups and topic creation before the send count against the
        lease: they have run by now.
        """
        left = self._lease.left(lease_ends)
        if not self._lease.room_to_send(left):
            self.observer.send_skipped(len(messages), left)
            return [Delivery() for _ in messages]
        sending = self.observer.before_send(messages)
        deliveries: list[Delivery] = []
        try:
            deliveries = self.publisher.send(sending, timeout=self._send_timeout, abort=self._abort)
        finally:
            # Messages without a delivery (the send raised) count as not sent.
            missing = len(sending) - len(deliveries)
            self.observer.after_send(sending, deliveries + [Delivery() for _ in range(missing)])
        return deliveries
