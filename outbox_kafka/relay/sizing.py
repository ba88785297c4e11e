"""How many keys each claim asks for, and when to read the next claim ahead."""

from __future__ import annotations

from outbox_kafka.relay.batches import Claim
from outbox_kafka.relay.checks import sendable


def worth_reading_ahead(claim: Claim, asked: int, batch_size: int) -> bool:
    """Whether to read the next claim while this one is sent.

    Only when the relay is behind: the claim filled half the batch or ran
    out of keys to ask for. A claim read ahead is taken before the events
    committed during the send, so when the relay keeps up, reading ahead
    would make every event wait one cycle more.
    """
    if not any(k.events and k.events[0].due for k in claim.keys):
        return False
    return claim.event_count * 2 >= batch_size or len(claim.keys) >= asked


class ClaimSizer:
    """Claim fewer keys when keys have several events waiting, more when they have few.

    Most of a cycle's database work is per key (lease, release), so a backlog
    of a few events on each of many keys is best served a few events per key,
    not one; a hot key already gets the whole batch.
    """

    def __init__(self, batch_size: int) -> None:
        self.batch_size = batch_size
        #: How many keys the next claim asks for.
        self.keys_per_claim = batch_size

    def adapt(self, claim: Claim, asked: int) -> None:
        """Size the next claim after ``claim``, which asked for ``asked`` keys."""
        batch = self.batch_size
        if not claim.keys or any(k.withheld for k in claim.keys):
            # The byte budget, not the number of keys, bounded this claim.
            return
        # What each key can send now: a key whose events switch topics sends
        # only its first run, however many events it brought.
        runs = [len(sendable(k)) for k in claim.keys]
        # Keys that can send their whole share of the batch and had more waiting.
        full = sum(
            1
            for k, run in zip(claim.keys, runs, strict=True)
            if run >= claim.per_key_limit and (k.last_seq is None or k.waiting > len(k.events))
        )
        floor = max(1, batch // 64)
        if full * 2 > len(claim.keys) > floor:
            # Also when fewer keys were due than asked for: what counts is that
            # most keys had more waiting than their share of the batch. Enough
            # keys for a full batch at the typical key's backlog, at most half.
            waiting = sorted(k.waiting for k in claim.keys)[len(claim.keys) // 2]
            self.keys_per_claim = max(floor, min(len(claim.keys) // 2, batch // waiting))
        elif sum(runs) * 4 < batch * 3 and len(claim.keys) >= asked and asked < batch:
            self.keys_per_claim = min(batch, asked * 2)
