"""Without the otel extra: nothing of OpenTelemetry is imported, and nothing is traced."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_without_opentelemetry_enqueue_and_the_relay_trace_nothing() -> None:
    script = textwrap.dedent(
        """
        import sys

        class Hide:
            def find_spec(self, name, path=None, target=None):
                if name == "opentelemetry" or name.startswith("opentelemetry."):
                    raise ImportError(f"hidden: {name}")
                return None

        sys.meta_path.insert(0, Hide())
        import outbox_kafka
        from outbox_kafka.producer.trace_context import current_traceparent
        from outbox_kafka.relay.ports import Delivery, Message
        from outbox_kafka.relay.observe import SendTracing

        assert current_traceparent() is None
        message = Message("t", b"k", b"{}", [("id", b"x")], "x")
        traced, spans = SendTracing().start([message])
        assert traced == [message] and spans == []
        SendTracing.finish(spans, [Delivery()])
        event = outbox_kafka.Outbox(allow_unknown_types=True).encode(
            outbox_kafka.Event(type="t.e", key="k", data={}, topic="t")
        )
        assert "traceparent" not in event.envelope
        assert not [m for m in sys.modules if m.startswith("opentelemetry")]
        print("ok")
        """
    )
    ran = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert ran.returncode == 0 and ran.stdout.strip() == "ok", ran.stdout + ran.stderr
