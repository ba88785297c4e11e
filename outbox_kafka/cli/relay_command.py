"""``outbox-kafka relay``: its options, its settings, signals and the HTTP endpoints."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from outbox_kafka.database import url_secrets
from outbox_kafka.errors import ConfigurationError, OutboxError
from outbox_kafka.logs import LOG_FORMATS, configure_logging
from outbox_kafka.relay.config import (
    COMPRESSIONS,
    SECONDS_PER_DAY,
    RelaySettings,
    kafka_config_from_env,
    kafka_config_from_file,
    parse_kafka_pair,
)

from .options import add_database_option, add_flag, add_option, add_table_options, env_name

if TYPE_CHECKING:
    from outbox_kafka.relay.group import OutboxTarget, RelayGroup
    from outbox_kafka.relay.log_relay import LogRelay
    from outbox_kafka.relay.loop import Relay
    from outbox_kafka.relay.serve import ObservabilityServer

#: Where ``relay`` serves /metrics, /healthz and /readyz unless told otherwise.
DEFAULT_METRICS_PORT = 9400
#: `relay --drain` ended with events still pending (the summary says why).
EXIT_WORK_LEFT = 3
DEFAULT_METRICS_HOST = "0.0.0.0"
#: Seconds past ``--shutdown-timeout`` the process waits, after the first SIGTERM or
#: SIGINT, for its loops to finish (the producer's last flush takes up to 5 of them,
#: the purge and sampler loops up to 5 each to notice the stop), before it exits
#: without them: a database or broker that stops answering, without closing its
#: connections, can hold a call for good.
FORCED_EXIT_GRACE = 10.0
#: Where ``--source`` may take events from.
SOURCES = ("table", "log")


#: Why ``--source log`` with ``--outboxes-file`` is refused (by the relay and by check).
LOG_SERVES_ONE_OUTBOX = "--source log serves one outbox; --outboxes-file is for the polling relay"

#: The options only the polling relay reads, each with the setting it fills.
POLLING_ONLY = (
    ("--max-claim-bytes", "max_claim_bytes"),
    ("--max-attempts", "max_attempts"),
    ("--on-exhausted", "on_exhausted"),
    ("--on-unproven", "on_unproven"),
    ("--no-listen", "listen"),
    ("--retain-delivered-days", "retain_delivered_seconds"),
    ("--retain-discarded-days", "retain_discarded_seconds"),
    ("--purge-interval", "purge_interval"),
)

log = logging.getLogger("outbox_kafka.cli")


def outbox_targets(args: argparse.Namespace) -> list[OutboxTarget] | None:
    """The outboxes of ``--outboxes-file``, or None without one."""
    if not args.outboxes_file:
        return None
    from outbox_kafka.relay.group import load_outboxes

    return load_outboxes(
        args.outboxes_file,
        database_url=args.database_url,
        table=args.table,
        db_schema=args.db_schema,
    )


def log_relay_settings(args: argparse.Namespace) -> RelaySettings:
    """The settings of ``relay --source log`` (and its check) from its options.

    Refuses ``--outboxes-file``, and each option of :data:`POLLING_ONLY` set to
    anything but its default (by the option or its variable): the log relay would
    not use it, and an operator who set it expects what it does.
    """
    if args.outboxes_file:
        raise OutboxError(LOG_SERVES_ONE_OUTBOX)
    settings = relay_settings(args, None)
    defaults = {f.name: f.default for f in dataclasses.fields(RelaySettings)}
    unused = [
        f"{flag} ({env_name(flag)})"
        for flag, name in POLLING_ONLY
        if getattr(settings, name) != defaults[name]
    ]
    if unused:
        raise OutboxError(
            f"--source log does not use {', '.join(unused)}: only the polling relay "
            "retries, parks and keeps events in its tables; drop "
            f"{'them' if len(unused) > 1 else 'it'} (see "
            "docs/reference/cli.md#relay---source-log)"
        )
    return settings


def relay_settings(
    args: argparse.Namespace, targets: list[OutboxTarget] | None = None
) -> RelaySettings:
    """The relay's settings from its options (and the ``OUTBOX_KAFKA_CONFIG_*`` variables).

    With ``targets`` (several outboxes), the settings every outbox shares,
    after checking each outbox's own (its database, table and the settings of
    its entry) against them.
    """
    kafka = kafka_config_from_env()
    if args.kafka_config_file:
        kafka.update(kafka_config_from_file(args.kafka_config_file))
    for pair in args.kafka_config or []:
        key, value = parse_kafka_pair(pair)
        kafka[key] = value
    database_url = args.database_url or (targets[0].database_url if targets else "")
    shared = RelaySettings(
        database_url=database_url,
        bootstrap_servers=args.bootstrap_servers or "",
        table=args.table,
        db_schema=args.db_schema,
        kafka_config=kafka,
        batch_size=args.batch_size,
        max_claim_bytes=args.max_claim_bytes,
        poll_interval=args.poll_interval,
        lease_seconds=args.lease_seconds,
        delivery_timeout_ms=args.delivery_timeout_ms,
        backoff_base=args.backoff_base,
        backoff_cap=args.backoff_cap,
        max_attempts=args.max_attempts,
        compression=args.compression,
        dead_letter_topic=args.dead_letter_topic or None,
        on_exhausted=args.on_exhausted,
        on_unproven=args.on_unproven,
        create_topics=args.create_topics,
        listen=not args.no_listen,
        shutdown_timeout=args.shutdown_timeout,
        retain_delivered_seconds=args.retain_delivered_days * SECONDS_PER_DAY,
        retain_discarded_seconds=args.retain_discarded_days * SECONDS_PER_DAY,
        purge_interval=args.purge_interval,
        sample_interval=args.sample_interval,
    )
    if targets:
        from outbox_kafka.relay.group import settings_for

        for target in targets:
            settings_for(shared, target)  # each outbox's own settings, refused at once
    return shared


def _metrics_port(args: argparse.Namespace) -> int | None:
    """The port to serve /metrics, /healthz and /readyz on, or None for no server.

    ``relay`` serves on 9400 by default; ``relay --drain`` only when a port is
    given. Port 0 turns the server off.
    """
    port: int | None = args.metrics_port
    if port is None:
        port = None if args.drain else DEFAULT_METRICS_PORT
    if port is not None and not 0 <= port <= 65535:
        raise OutboxError(f"--metrics-port must be between 0 and 65535, got {port}")
    return port or None


def _start_server(
    relay: Relay | RelayGroup, args: argparse.Namespace
) -> ObservabilityServer | None:
    """Serve the relay's endpoints, if wanted.

    A port given explicitly must be free (else exit 2); the default port, when
    taken (several relays on one host), is skipped with a warning.
    """
    from outbox_kafka.relay.loop import Relay
    from outbox_kafka.relay.serve import ObservabilityServer

    port = _metrics_port(args)
    if port is None:
        return None
    try:
        if isinstance(relay, Relay):
            server = ObservabilityServer.for_relay(relay, host=args.metrics_host, port=port)
        else:
            server = ObservabilityServer.for_group(relay, host=args.metrics_host, port=port)
    except ConfigurationError as exc:
        if args.metrics_port is not None:
            raise
        log.warning(
            "metrics and health endpoints not served: the default port is taken",
            extra={"action": "http_unavailable", "error": str(exc)},
        )
        return None
    return server.start()


def _cmd_relay(args: argparse.Namespace) -> int:
    # First, so that a signal while the relay starts stops it too, rather than
    # ending the process the way an unhandled SIGTERM does.
    stopping = _StopSignals(args.shutdown_timeout)
    from outbox_kafka.relay.group import RelayGroup
    from outbox_kafka.relay.loop import Relay

    if args.source == "log":
        return _cmd_log_relay(args, stopping)
    targets = outbox_targets(args)
    settings = relay_settings(args, targets)
    secrets = list(settings.secret_values())
    for target in targets or []:
        secrets.extend(url_secrets(target.database_url))
    configure_logging(args.log_format, args.log_level, secrets=secrets)
    _metrics_port(args)  # a bad port is refused before anything starts
    relay = Relay(settings) if targets is None else RelayGroup(settings, targets)
    try:
        server = _start_server(relay, args)
    except BaseException:
        relay.close()
        raise
    try:
        stopping.attach(relay)
        # What start-up made (modules, the engine, the producer) lives as long as the
        # process: out of the garbage collector's sight, its full collections no
        # longer walk it while the loop makes and drops a batch's objects. Start-up's
        # own garbage is collected first, so that none of it stays for good.
        gc.collect()
        gc.freeze()
        return stopping.run_until_stopped(
            lambda: _run_relay(args, relay), EXIT_WORK_LEFT if args.drain else 0
        )
    finally:
        if server is not None:
            server.close()


def _cmd_log_relay(args: argparse.Namespace, stopping: _StopSignals) -> int:
    """``relay --source log``: one outbox's events read from its replication slot."""
    from outbox_kafka.relay.log_relay import LogRelay, LogStalled
    from outbox_kafka.relay.serve import ObservabilityServer

    settings = log_relay_settings(args)
    configure_logging(args.log_format, args.log_level, secrets=list(settings.secret_values()))
    port = _metrics_port(args)
    relay = LogRelay(settings)
    server: ObservabilityServer | None = None
    if port is not None:
        try:
            server = ObservabilityServer.for_log_relay(
                relay, host=args.metrics_host, port=port
            ).start()
        except ConfigurationError as exc:
            if args.metrics_port is not None:
                relay.close(0)
                raise
            log.warning(
                "metrics and health endpoints not served: the default port is taken",
                extra={"action": "http_unavailable", "error": str(exc)},
            )

    def body() -> int:
        if not args.drain:
            relay.run()
            return 0
        try:
            relay.open()
            relay.drain(idle=1.0, deadline=args.drain_timeout)
        except LogStalled as exc:
            print(f"stalled after {relay.published} events: {exc}")
            return EXIT_WORK_LEFT
        finally:
            relay.close(settings.shutdown_timeout)
        aside = (
            f", {relay.dead_lettered} set aside to the dead-letter topic"
            if relay.dead_lettered
            else ""
        )
        print(f"published {relay.published} events from the log{aside}")
        return 0

    try:
        stopping.attach(relay)
        gc.collect()
        gc.freeze()
        return stopping.run_until_stopped(body, EXIT_WORK_LEFT if args.drain else 0)
    finally:
        if server is not None:
            server.close()


class _StopSignals:
    """SIGTERM and SIGINT for ``relay``: the first stops the relay, a second exits at once.

    The relay runs on a thread of its own (:meth:`run_until_stopped`) while the main
    thread, where Python runs signal handlers, waits for it: a handler runs even while
    the relay is stuck in a call that does not return, and the process exits at the
    latest :data:`FORCED_EXIT_GRACE` seconds past ``shutdown_timeout`` after the first
    signal. What was not recorded by then waits for its keys' leases, as after a crash.
    """

    def __init__(self, shutdown_timeout: float) -> None:
        self.shutdown_timeout = shutdown_timeout
        self.signals = 0
        #: ``time.monotonic()`` past which the process exits without its relay.
        self.deadline: float | None = None
        self._relay: Relay | RelayGroup | LogRelay | None = None
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)

    def _on_signal(self, signum: int, frame: object) -> None:
        self.signals += 1
        if self.signals > 1:
            # Second signal: leave now; leases hand the in-flight keys to another relay.
            os._exit(128 + signum)
        self._stop_relay()

    def attach(self, relay: Relay | RelayGroup | LogRelay) -> None:
        """The relay to stop; stopped at once if a signal came while it was made."""
        self._relay = relay
        if self.signals:
            self._stop_relay()

    def _stop_relay(self) -> None:
        """Stop the relay, if it is made yet; the deadline runs from here, as its
        shutdown timeout does."""
        if self._relay is not None:
            self.deadline = time.monotonic() + self.shutdown_timeout + FORCED_EXIT_GRACE
            self._relay.stop()

    def run_until_stopped(self, body: Callable[[], int], forced_exit: int) -> int:
        """``body()``'s exit status, run on its own thread; after the first signal,
        ``forced_exit`` if it has not returned by the deadline."""
        outcome: list[int] = []
        failure: list[BaseException] = []

        def run() -> None:
            try:
                outcome.append(body())
            except BaseException as exc:  # re-raised on the main thread
                failure.append(exc)

        worker = threading.Thread(target=run, name="outbox-relay", daemon=True)
        worker.start()
        while worker.is_alive():
            worker.join(0.2)
            past = self.deadline is not None and time.monotonic() > self.deadline
            if past and worker.is_alive():
                self._force_exit(forced_exit)
        if failure:
            raise failure[0]
        return outcome[0]

    @staticmethod
    def _force_exit(code: int) -> None:
        """Say why, then leave without the relay's thread. A stuck thread may hold the
        log handler's lock (blocked on a full stderr pipe): the exit does not wait
        for the log line longer than 2 s."""
        backstop = threading.Timer(2.0, os._exit, (code,))
        backstop.daemon = True
        backstop.start()
        log.error(
            "the relay did not stop within --shutdown-timeout: a call to the "
            "database or Kafka is not returning; exiting without it, and what it "
            "had not recorded waits for its keys' leases",
            extra={"action": "forced_exit", "grace_seconds": FORCED_EXIT_GRACE},
        )
        logging.shutdown()
        with contextlib.suppress(OSError, ValueError):
            sys.stdout.flush()
        os._exit(code)


def _run_relay(args: argparse.Namespace, relay: Relay | RelayGroup) -> int:
    if args.drain:
        try:
            drained = relay.drain_all(args.drain_timeout)
        finally:
            relay.close()
        results = drained if isinstance(drained, dict) else {"": drained}
        complete = True
        for name, result in results.items():
            complete = complete and result.complete
            print(f"outbox {name}: {result.summary()}" if name else result.summary())
        return 0 if complete else EXIT_WORK_LEFT
    relay.run()
    return 0


def add_relay_parser(
    sub: Any, name: str = "relay", help: str = "publish committed outbox events to Kafka"
) -> argparse.ArgumentParser:
    """The relay's parser; ``check`` is built on it so it validates the same settings.

    Every default that is a relay setting is :class:`RelaySettings`' own.
    """
    p: argparse.ArgumentParser = sub.add_parser(name, help=help, description=help)
    add_database_option(p)
    add_option(
        p,
        "--bootstrap-servers",
        env="OUTBOX_KAFKA_BOOTSTRAP_SERVERS",
        help="Kafka bootstrap servers, host:port[,host:port]",
    )
    p.add_argument(
        "--kafka-config",
        action="append",
        metavar="KEY=VALUE",
        help="any librdkafka setting, repeatable; also OUTBOX_KAFKA_CONFIG_<NAME> "
        "with dots as underscores, e.g. OUTBOX_KAFKA_CONFIG_SECURITY_PROTOCOL=SSL",
    )
    add_option(p, "--kafka-config-file", help="file of librdkafka key=value lines")
    add_table_options(p)
    add_option(
        p,
        "--outboxes-file",
        help="serve several outboxes (databases, or schemas of one): a TOML file of "
        "[outboxes.<name>] entries, each with database_url or database_url_env and "
        "optionally schema and table (defaults: --database-url, --db-schema, --table) "
        "and settings of its own loop such as batch_size or lease_seconds (defaults: "
        "the options); see docs/howto/several-outboxes.md",
    )
    defaults = RelaySettings
    add_option(
        p, "--batch-size", type=int, default=defaults.batch_size, help="events claimed per cycle"
    )
    add_option(
        p,
        "--max-claim-bytes",
        type=int,
        default=defaults.max_claim_bytes,
        help="bytes of event values and headers one claim reads at most (an event larger "
        "than this still goes, alone); bounds the relay's memory, see docs/explanation/design.md",
    )
    add_option(
        p,
        "--poll-interval",
        type=float,
        default=defaults.poll_interval,
        help="seconds between polls when idle",
    )
    add_option(
        p,
        "--lease-seconds",
        type=float,
        default=defaults.lease_seconds,
        help="per-key lease length",
    )
    add_option(
        p,
        "--delivery-timeout-ms",
        type=int,
        default=defaults.delivery_timeout_ms,
        help="Kafka delivery timeout; must be at most 80%% of the lease",
    )
    add_option(
        p,
        "--backoff-base",
        type=float,
        default=defaults.backoff_base,
        help="first retry delay, seconds",
    )
    add_option(
        p,
        "--backoff-cap",
        type=float,
        default=defaults.backoff_cap,
        help="largest retry delay, seconds",
    )
    add_option(
        p,
        "--max-attempts",
        type=int,
        default=defaults.max_attempts,
        help="sends before an event is discarded",
    )
    add_option(
        p,
        "--compression",
        default=defaults.compression,
        choices=COMPRESSIONS,
        help="Kafka compression codec",
    )
    add_option(
        p,
        "--dead-letter-topic",
        default=defaults.dead_letter_topic,
        help="copy discarded events to this topic",
    )
    add_option(
        p,
        "--on-exhausted",
        default=defaults.on_exhausted,
        choices=("continue", "park"),
        help="after a discard: let the key continue, or park it until requeued",
    )
    add_option(
        p,
        "--on-unproven",
        default=defaults.on_unproven,
        choices=("wait", "send"),
        help="a key in doubt whose read-back of Kafka proves nothing: wait and read "
        "again (exactly once), or send it anyway (at least once)",
    )
    add_option(
        p,
        "--create-topics",
        type=int,
        default=defaults.create_topics,
        help="create missing topics with this many partitions",
    )
    add_flag(p, "--no-listen", help="poll only; do not LISTEN for enqueue notifications")
    add_option(
        p,
        "--shutdown-timeout",
        type=float,
        default=defaults.shutdown_timeout,
        help="seconds to finish on SIGTERM",
    )
    add_option(
        p,
        "--retain-delivered-days",
        type=float,
        default=defaults.retain_delivered_seconds / SECONDS_PER_DAY,
        help="keep delivered events",
    )
    add_option(
        p,
        "--retain-discarded-days",
        type=float,
        default=defaults.retain_discarded_seconds / SECONDS_PER_DAY,
        help="keep discarded events",
    )
    add_option(
        p,
        "--purge-interval",
        type=float,
        default=defaults.purge_interval,
        help="seconds between retention runs",
    )
    add_flag(
        p,
        "--drain",
        help="publish everything, waiting for what comes due within --drain-timeout "
        "(other relays' leases, retries, delays, keys held for a missing topic or a "
        f"missing grant); exit 0 when nothing is left pending, {EXIT_WORK_LEFT} when "
        "something is (the summary says what and why, held events with their reason) or "
        "when a SIGTERM's deadline passed first (logged as forced_exit, no summary)",
    )
    add_option(
        p,
        "--drain-timeout",
        type=float,
        default=120.0,
        help="with --drain: the longest wait for work to come due, seconds",
    )
    add_option(
        p,
        "--source",
        choices=SOURCES,
        default="table",
        help="where the events come from: 'table', the outbox's tables (polled); 'log', "
        "the write-ahead log, read from the outbox's replication slot, for producers "
        "with Outbox(write_to='log') (see docs/reference/api.md); with 'log', the "
        "options of retries, parking, retention and several outboxes are refused (see "
        "docs/reference/cli.md#relay---source-log)",
    )
    add_option(
        p,
        "--sample-interval",
        type=float,
        default=defaults.sample_interval,
        help="seconds between samples of the backlog gauges (pending, oldest age, parked keys)",
    )
    add_option(
        p,
        "--metrics-port",
        type=int,
        help="port for /metrics, /healthz and /readyz; 0 turns the server off "
        f"(default: {DEFAULT_METRICS_PORT}; with --drain: off unless given)",
    )
    add_option(
        p,
        "--metrics-host",
        default=DEFAULT_METRICS_HOST,
        help="address the metrics and health server listens on; 0.0.0.0 is every "
        "interface, 127.0.0.1 (or one interface's address) restricts it",
    )
    add_option(p, "--log-format", default="text", choices=LOG_FORMATS, help="log format")
    add_option(p, "--log-level", default="INFO", help="log level")
    p.set_defaults(handler=_cmd_relay)
    return p
