"""Benchmarks for outbox-kafka: ``make bench`` (``python -m bench``).

Each bench module exposes ``run(ctx) -> list[Result]`` and is registered in
``bench.__main__.BENCHES``; ``bench.common`` holds the context, the timing
helpers, the result tables and the ``bench/results.md`` writer.
"""

from __future__ import annotations
