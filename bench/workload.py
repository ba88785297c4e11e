"""The events the relay benches write: ``order.paid`` payloads of a chosen size, keys.

A payload of ``size`` bytes is an ``order.paid`` object whose compact JSON
(as :class:`outbox_kafka.producer.data.DataEncoder` writes it) is exactly ``size``
bytes long; the padding goes into ``payment_id``, so every payload still
validates against ``schemas/events/order.paid.json``.
"""

from __future__ import annotations

import json
import random
import string
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from outbox_kafka import Event

from .producer import EVENT_TYPE

#: Payload sizes (bytes of JSON data) the size-dependent measurements use.
SIZES = (200, 2_048, 20_480)
DEFAULT_SIZE = SIZES[0]

_ALPHABET = string.ascii_letters + string.digits
_CURRENCIES = ("EUR", "USD", "GBP", "CHF")


def size_label(size: int) -> str:
    """``200`` -> ``200 B``, ``2048`` -> ``2 KiB``."""
    if size >= 1024 and size % 1024 == 0:
        return f"{size // 1024} KiB"
    return f"{size:,} B"


def _json_length(data: dict[str, Any]) -> int:
    return len(json.dumps(data, separators=(",", ":"), ensure_ascii=False).encode())


def payload(rng: random.Random, i: int, size: int = DEFAULT_SIZE) -> dict[str, Any]:
    """An ``order.paid`` payload of exactly ``size`` bytes of JSON (at least ~90)."""
    data: dict[str, Any] = {
        "order_id": f"ord_{i:08d}_" + "".join(rng.choices(_ALPHABET, k=8)),
        "payment_id": "pay_",
        "amount_cents": rng.randrange(100, 10_000_000),
        "currency": rng.choice(_CURRENCIES),
    }
    padding = size - _json_length(data)
    if padding < 0:
        raise ValueError(f"a payload cannot be as small as {size} bytes")
    # Hex of random bytes: cheap to make at 20 KiB (random characters one by one were not).
    data["payment_id"] += rng.randbytes((padding + 1) // 2).hex()[:padding]
    return data


def events_for(
    count: int,
    key_of: Callable[[int], str],
    topic: str,
    size: int = DEFAULT_SIZE,
    seed: int = 42,
) -> Iterator[Event]:
    """``count`` ``order.paid`` events for ``topic``; event ``i`` has key ``key_of(i)``."""
    rng = random.Random(seed)
    for i in range(count):
        yield Event(type=EVENT_TYPE, key=key_of(i), data=payload(rng, i, size), topic=topic)


def key_name(n: int) -> str:
    """The ``n``-th ordinary key; :mod:`bench.tables` builds the same names in SQL."""
    return f"customer-{n:05d}"


#: The one key of the hot-key shapes.
HOT_KEY = "customer-hot"


def spread(keys: int) -> Callable[[int], str]:
    """Event ``i`` on key ``customer-<i mod keys>``."""
    return lambda i: key_name(i % keys)


def chunks(items: Iterable[Event], size: int) -> Iterator[list[Event]]:
    batch: list[Event] = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch
