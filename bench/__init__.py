"""Benchmarks for outbox-kafka: ``make bench`` (``python -m bench``).

Each section module (producer, async, relay = throughput, hotkey, backlog, latency)
exposes ``run(ctx) -> list[Result]`` and is registered in
``bench.__main__.BENCHES``. ``bench.common`` holds the context, the results
with their targets, the tables and the ``bench/results.md`` writer;
``bench.plots`` draws the PNGs; ``workload``, ``broker``, ``tables`` and
``processes`` are what the relay sections share (events, topics, databases,
relay processes).
"""

from __future__ import annotations
