"""``python -m outbox_kafka.cli``: the ``outbox-kafka`` command."""

from outbox_kafka.cli import main

raise SystemExit(main())
