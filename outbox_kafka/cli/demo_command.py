"""``outbox-kafka demo``: the orders demo, end to end on embedded services."""

from __future__ import annotations

import argparse
from typing import Any

from .options import add_option


def _cmd_demo(args: argparse.Namespace) -> int:
    from outbox_kafka.demo.run import run_demo

    return run_demo(args)


def add_demo_parser(sub: Any) -> None:
    p = sub.add_parser("demo", help="run the orders demo end to end on embedded services")
    add_option(p, "--orders", type=int, default=400, help="orders to create, pay and ship")
    add_option(p, "--writers", type=int, default=4, help="concurrent order-service threads")
    p.set_defaults(handler=_cmd_demo)
