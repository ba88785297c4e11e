"""The caller's current trace context, as a ``traceparent``, when OpenTelemetry is installed.

``enqueue`` stores it with an event given no ``traceparent`` of its own, so
the trace of the request that wrote the event goes on through the relay to
the consumers. Without the ``opentelemetry-api`` package (the ``otel``
extra), nothing is imported and no context is taken.
"""

from __future__ import annotations

from typing import Any

_trace: Any
try:
    from opentelemetry import trace as _trace
except ImportError:  # the otel extra is not installed
    _trace = None


def current_traceparent() -> str | None:
    """The W3C ``traceparent`` of the current span, or None (no span, or no OpenTelemetry)."""
    if _trace is None:
        return None
    context = _trace.get_current_span().get_span_context()
    if not context.is_valid:
        return None
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{int(context.trace_flags):02x}"
