"""What both peer scripts share: the events they write and their common arguments.

Imported by the scripts as a sibling module (they run as files, from this folder,
in the peers' virtualenv), never by the bench.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Iterator
from typing import Any


def payload(i: int, keys: int, size: int) -> dict[str, Any]:
    """Event ``i``: its key and per-key sequence number, padded to ``size`` bytes of JSON."""
    key = f"customer-{i % keys:05d}"
    data: dict[str, Any] = {"bench_key": key, "bench_seq": i // keys + 1, "pad": ""}
    room = size - len(json.dumps(data, separators=(",", ":")))
    data["pad"] = random.Random(i).randbytes((max(0, room) + 1) // 2).hex()[: max(0, room)]
    return data


def workload(events: int, keys: int, size: int) -> Iterator[dict[str, Any]]:
    for i in range(events):
        yield payload(i, keys, size)


def common_parser(description: str | None) -> argparse.ArgumentParser:
    """The arguments of both scripts; each adds its own tuning knobs."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("command", choices=("fill", "relay"))
    p.add_argument("--database-url", required=True, help="a postgresql+asyncpg:// URL")
    p.add_argument("--bootstrap", default="")
    p.add_argument("--topic", default="")
    p.add_argument("--events", type=int, default=0)
    p.add_argument("--keys", type=int, default=1)
    p.add_argument("--size", type=int, default=500)
    p.add_argument("--fill-batch", type=int, default=1000)
    p.add_argument(
        "--idempotence",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="enable_idempotence",
    )
    return p
