"""``outbox-kafka dev``: a local PostgreSQL and Kafka-protocol broker that run until stopped."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any

from outbox_kafka.errors import ConfigurationError

from .options import add_option

_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _port(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _cmd_dev(args: argparse.Namespace) -> int:
    from outbox_kafka.demo.local_stack import (
        StackSettings,
        default_data_dir,
        environment_for,
        export_lines,
        start_local_stack,
    )

    settings = StackSettings(
        data_dir=Path(args.data_dir) if args.data_dir else default_data_dir(),
        postgres_port=args.postgres_port,
        kafka_port=args.kafka_port,
        migrate=args.migrate,
        log_mode=args.log_mode,
    )
    if args.print_env:
        if not (settings.postgres_port and settings.kafka_port):
            raise ConfigurationError("--print-env needs fixed ports, not 0")
        sys.stdout.write(export_lines(environment_for(settings.postgres_port, settings.kafka_port)))
        return 0

    stopping = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stopping.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in _STOP_SIGNALS}
    try:
        _say(f"starting PostgreSQL and the broker (data in {settings.data_dir}) ...")
        stack = start_local_stack(settings)
        try:
            exports = export_lines(stack.environment)
            if args.env_file:
                env_file = Path(args.env_file)
                env_file.write_text(exports)
            _say(
                f"PostgreSQL on 127.0.0.1:{stack.postgres.port} "
                f"(data kept in {stack.postgres.data_dir}, log {stack.postgres.log_path})"
            )
            _say(
                f"broker on 127.0.0.1:{stack.broker.port} "
                f"(topics in memory only, log {stack.broker.log_path})"
            )
            if settings.migrate:
                _say("outbox tables created (outbox-kafka migrate)")
            _say("export these in another shell (or source --env-file); Ctrl-C stops both:")
            sys.stdout.write(exports)
            sys.stdout.flush()
            if args.env_file:
                _say(f"written to {args.env_file}: . {args.env_file}")
            while not stopping.wait(0.5):
                problem = stack.problem()
                if problem is not None:
                    _say(f"outbox-kafka dev: error: {problem}; stopping")
                    return 1
            _say("stopping ...")
            return 0
        finally:
            stack.stop()
            _say("stopped PostgreSQL and the broker")
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def add_dev_parser(sub: Any) -> None:
    p = sub.add_parser(
        "dev",
        help="run PostgreSQL and a Kafka-protocol broker locally until Ctrl-C, "
        "printing the environment to export",
    )
    add_option(
        p,
        "--data-dir",
        help="where PostgreSQL keeps its data between runs and the logs go "
        "(default: $XDG_CACHE_HOME/outbox-kafka/dev, else ~/.cache/outbox-kafka/dev)",
        env="OUTBOX_DEV_DATA_DIR",
    )
    add_option(
        p,
        "--postgres-port",
        type=_port,
        default=55432,
        help="PostgreSQL's port on 127.0.0.1; 0: any free port",
        env="OUTBOX_DEV_POSTGRES_PORT",
    )
    add_option(
        p,
        "--kafka-port",
        type=_port,
        default=59092,
        help="the broker's port on 127.0.0.1; 0: any free port",
        env="OUTBOX_DEV_KAFKA_PORT",
    )
    p.add_argument(
        "--migrate",
        action="store_true",
        help="create the outbox tables (as outbox-kafka migrate does) once started",
    )
    p.add_argument(
        "--log-mode",
        action="store_true",
        help="start PostgreSQL with wal_level = logical, for the log mode "
        "(Outbox(write_to='log'), relay --source log)",
    )
    add_option(
        p,
        "--env-file",
        help="also write the export lines to this file (overwritten) once both are ready",
        env="OUTBOX_DEV_ENV_FILE",
    )
    p.add_argument(
        "--print-env",
        action="store_true",
        help="print the export lines for these ports and exit, starting nothing",
    )
    p.set_defaults(handler=_cmd_dev)
