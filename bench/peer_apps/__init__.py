"""Scripts the peers section (:mod:`bench.peers`) runs inside the peers' own virtualenv.

Each script is run by path with that virtualenv's interpreter (Python 3.12 or
newer), never imported by the bench: it imports the peer library, which is not
installed next to outbox-kafka. Every script has two commands, ``fill`` (write
the workload through the peer's own producer API and exit) and ``relay`` (run
the peer's publisher until SIGTERM), and builds its events as
:func:`bench.peers.workload` does: event ``i`` on key ``customer-<i mod keys>``
with per-key sequence number ``i // keys + 1``, both in the payload.
"""
