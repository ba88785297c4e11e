"""The version of outbox-kafka, in a module of its own.

Any part of the package that reports its version (the CLI's ``--version``, the
relay's build-info metric and tracer) imports it from here, never from the
package root, so that no module imports upward.
"""

from __future__ import annotations

__version__ = "0.1.0"
