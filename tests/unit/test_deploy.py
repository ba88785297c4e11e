"""The deployable stack, checked without running it: Dockerfile, compose, Prometheus, Grafana, k8s.

Every cross-reference is checked against its source of truth: the metric names
the dashboard queries against a real ``RelayMetrics`` registry, the ``OUTBOX_*``
variables against the CLI's own ``--help``, ports against the Dockerfile's
EXPOSE, the shutdown timeout against ``RelaySettings``.
"""

from __future__ import annotations

import contextlib
import fnmatch
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, fields
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from outbox_kafka import cli
from outbox_kafka.cli.relay_command import FORCED_EXIT_GRACE
from outbox_kafka.relay.config import SECRET_KAFKA_KEYS, RelaySettings, kafka_config_from_env
from outbox_kafka.relay.metrics import RelayMetrics

REPO = Path(__file__).resolve().parent.parent.parent
DEPLOY = REPO / "deploy"
K8S = DEPLOY / "k8s"
COMPOSE = REPO / "docker-compose.yml"
PROMETHEUS_CONFIG = DEPLOY / "prometheus" / "prometheus.yml"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "outbox.json"
GRAFANA_PROVISIONING = DEPLOY / "grafana" / "provisioning"

# Series a metric family of each type puts on /metrics (the text exposition format).
_SERIES_SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("", "_sum", "_count", "_created"),
    "info": ("_info",),
    "stateset": ("",),
    "gaugehistogram": ("_bucket", "_gsum", "_gcount"),
    "unknown": ("",),
}
_METRIC_NAME = re.compile(r"\boutbox_[a-zA-Z0-9_]+")


# --------------------------------------------------------------------------- sources of truth


def relay_series() -> set[str]:
    """Every series name a relay's /metrics can carry, from a real registry."""
    registry = RelayMetrics().registry
    names: set[str] = set()
    for family in registry.collect():
        names.update(sample.name for sample in family.samples)
        names.update(family.name + suffix for suffix in _SERIES_SUFFIXES[family.type])
    return names


def cli_env_variables(command: str) -> set[str]:
    """The ``OUTBOX_*`` variables ``outbox-kafka COMMAND --help`` documents."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        cli.main([command, "--help"])
    return set(re.findall(r"\[env\s+(OUTBOX_[A-Z0-9_]+)\]", out.getvalue()))


def known_variable(variable: str, command: str) -> bool:
    return variable in cli_env_variables(command) or (
        command == "relay" and variable.startswith("OUTBOX_KAFKA_CONFIG_")
    )


def default_shutdown_timeout() -> float:
    [field] = [f for f in fields(RelaySettings) if f.name == "shutdown_timeout"]
    return float(field.default)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- Dockerfile


@dataclass(frozen=True)
class Instruction:
    keyword: str
    args: str

    def exec_form(self) -> list[str]:
        value = json.loads(self.args)
        assert isinstance(value, list), f"{self.keyword} is not in exec form: {self.args}"
        return [str(v) for v in value]


def dockerfile_stages() -> list[list[Instruction]]:
    """The Dockerfile's instructions, stage by stage (continuation lines joined)."""
    text = (REPO / "Dockerfile").read_text()
    logical: list[str] = []
    pending = ""
    for line in text.splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        logical.append(pending + line)
        pending = ""
    stages: list[list[Instruction]] = []
    for entry in logical:
        keyword, _, args = entry.strip().partition(" ")
        instruction = Instruction(keyword.upper(), " ".join(args.split()))
        if instruction.keyword == "FROM":
            stages.append([])
        assert stages, f"instruction before FROM: {entry}"
        stages[-1].append(instruction)
    return stages


def runtime_stage() -> list[Instruction]:
    return dockerfile_stages()[-1]


def only(stage: list[Instruction], keyword: str) -> Instruction:
    found = [i for i in stage if i.keyword == keyword]
    assert len(found) == 1, f"expected one {keyword} in the runtime stage, found {found}"
    return found[0]


def image_env(stage: list[Instruction]) -> dict[str, str]:
    env: dict[str, str] = {}
    for instruction in stage:
        if instruction.keyword == "ENV":
            for pair in shlex.split(instruction.args):
                name, _, value = pair.partition("=")
                env[name] = value
    return env


def exposed_port() -> int:
    [port] = only(runtime_stage(), "EXPOSE").args.split()
    return int(port.split("/")[0])


def image_uid() -> int:
    user = only(runtime_stage(), "USER").args.split(":")[0]
    assert user.isdigit(), f"USER {user} is not numeric: Kubernetes cannot verify runAsNonRoot"
    return int(user)


def healthcheck_command() -> list[str]:
    args = only(runtime_stage(), "HEALTHCHECK").args
    assert " CMD " in f" {args} ", args
    return json.loads(args.split("CMD", 1)[1])  # type: ignore[no-any-return]


def test_the_image_runs_the_relay_as_a_non_root_user_on_python_slim() -> None:
    stages = dockerfile_stages()
    assert all(stage[0].args.split()[0] == "python:3.11-slim" for stage in stages)
    assert image_uid() != 0
    assert only(runtime_stage(), "ENTRYPOINT").exec_form() == ["outbox-kafka"]
    assert only(runtime_stage(), "CMD").exec_form() == ["relay"]


def test_the_image_installs_the_package_without_dev_or_embedded_extras() -> None:
    runs = " ".join(i.args for s in dockerfile_stages() for i in s if i.keyword == "RUN")
    assert "pip" in runs
    assert "outbox-kafka" in runs or "pip wheel" in runs
    for extra in ("[dev", "embedded", ".[", "-e "):
        assert extra not in runs, f"the image installs {extra!r}"


def test_the_image_exposes_the_metrics_port_it_binds_on_every_interface() -> None:
    env = image_env(runtime_stage())
    assert int(env["OUTBOX_METRICS_PORT"]) == exposed_port()
    assert env["OUTBOX_METRICS_HOST"] == "0.0.0.0"
    for variable in ("OUTBOX_METRICS_PORT", "OUTBOX_METRICS_HOST"):
        assert known_variable(variable, "relay"), f"{variable} is not a relay setting"


def test_the_image_healthcheck_asks_healthz_with_urllib() -> None:
    command = healthcheck_command()
    assert command[:2] == ["python", "-c"]
    assert "urllib" in command[2]
    assert "/healthz" in command[2]
    assert "curl" not in " ".join(command)


class _HealthServer:
    """A loopback HTTP server answering /healthz with a chosen status."""

    def __init__(self, status: int) -> None:
        self.paths: list[str] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                outer.paths.append(self.path)
                self.send_response(status if self.path == "/healthz" else 404)
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@contextlib.contextmanager
def health_server(status: int) -> Iterator[_HealthServer]:
    server = _HealthServer(status)
    try:
        yield server
    finally:
        server.close()


def run_healthcheck(command: list[str], port: int) -> int:
    assert command[0] == "python"
    env = {**os.environ, "OUTBOX_METRICS_PORT": str(port)}
    result = subprocess.run(
        [sys.executable, *command[1:]], env=env, capture_output=True, timeout=30, check=False
    )
    return result.returncode


def compose_healthcheck_command() -> list[str]:
    test = compose()["services"]["relay"]["healthcheck"]["test"]
    assert test[0] == "CMD", test
    return [str(part) for part in test[1:]]


@pytest.mark.parametrize("source", ["Dockerfile", "docker-compose.yml"])
def test_the_healthcheck_passes_on_200_and_fails_otherwise(source: str) -> None:
    command = healthcheck_command() if source == "Dockerfile" else compose_healthcheck_command()
    with health_server(200) as healthy:
        assert run_healthcheck(command, healthy.port) == 0
    assert healthy.paths == ["/healthz"]
    with health_server(503) as failing:
        assert run_healthcheck(command, failing.port) != 0
    assert failing.paths == ["/healthz"]


def dockerignore_excludes(path: str) -> bool:
    """Docker's rule: the last matching pattern wins; ``!`` re-includes."""
    excluded = False
    for raw in (REPO / ".dockerignore").read_text().splitlines():
        pattern = raw.strip()
        if not pattern or pattern.startswith("#"):
            continue
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!").rstrip("/")
        if pattern.startswith("**/"):
            matches = fnmatch.fnmatch(path, pattern) or fnmatch.fnmatch(path, pattern[3:])
        else:
            matches = fnmatch.fnmatch(path, pattern) or path.startswith(pattern + "/")
        if matches:
            excluded = not negate
    return excluded


def test_dockerignore_sends_what_the_build_copies_and_nothing_else() -> None:
    copied = [
        source
        for stage in dockerfile_stages()
        for i in stage
        if i.keyword == "COPY" and not i.args.startswith("--from")
        for source in i.args.split()[:-1]
    ]
    assert copied, "the Dockerfile copies nothing from the build context"
    for source in copied:
        assert (REPO / source).exists(), source
        assert not dockerignore_excludes(source.rstrip("/")), f"{source} is dockerignored"
    assert not dockerignore_excludes("outbox_kafka/relay.py")
    for private in (".venv/bin/python", ".git/HEAD", "tests/conftest.py", "bench/__main__.py"):
        assert dockerignore_excludes(private), f"{private} would be sent to the build"
    assert dockerignore_excludes("outbox_kafka/__pycache__/relay.cpython-311.pyc")


# --------------------------------------------------------------------------- docker compose


def compose() -> dict[str, Any]:
    document = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(document, dict)
    return document


def service(name: str) -> dict[str, Any]:
    services: dict[str, Any] = compose()["services"]
    assert name in services, f"no {name} service in docker-compose.yml"
    return services[name]  # type: ignore[no-any-return]


def environment(svc: dict[str, Any]) -> dict[str, str]:
    env = svc.get("environment", {})
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {str(k): str(v) for k, v in env.items()}


def published_ports(svc: dict[str, Any]) -> dict[int, int]:
    """container port -> host port."""
    mapping = {}
    for entry in svc.get("ports", []):
        host, _, container = str(entry).rpartition(":")
        mapping[int(container.split("/")[0])] = int(host)
    return mapping


def bind_mounts(svc: dict[str, Any]) -> dict[str, Path]:
    """container path -> repository path, for ``./`` bind mounts."""
    mounts = {}
    for entry in svc.get("volumes", []):
        source, target = str(entry).split(":")[:2]
        if source.startswith("./"):
            mounts[target] = REPO / source
    return mounts


def test_compose_has_the_whole_stack() -> None:
    assert set(compose()["services"]) == {
        "postgres",
        "kafka",
        "migrate",
        "relay",
        "orders",
        "prometheus",
        "grafana",
    }


def test_compose_postgres_is_the_official_image_with_pg_isready() -> None:
    postgres = service("postgres")
    assert re.fullmatch(r"postgres:(16|18)(\.\d+)?", postgres["image"])
    check = " ".join(postgres["healthcheck"]["test"])
    env = environment(postgres)
    assert "pg_isready" in check
    assert f"-U {env['POSTGRES_USER']}" in check
    assert f"-d {env['POSTGRES_DB']}" in check


def listeners(value: str) -> dict[str, tuple[str, int]]:
    """``NAME://host:port,...`` -> {NAME: (host, port)}."""
    found = {}
    for item in value.split(","):
        name, _, address = item.partition("://")
        host, _, port = address.rpartition(":")
        found[name] = (host, int(port))
    return found


def test_compose_kafka_is_a_consistent_single_node_kraft_broker() -> None:
    kafka = service("kafka")
    assert kafka["image"].startswith("apache/kafka:")
    env = environment(kafka)
    assert set(env["KAFKA_PROCESS_ROLES"].split(",")) == {"broker", "controller"}
    assert "CLUSTER_ID" in env
    bound = listeners(env["KAFKA_LISTENERS"])
    advertised = listeners(env["KAFKA_ADVERTISED_LISTENERS"])
    protocols = dict(
        pair.split(":") for pair in env["KAFKA_LISTENER_SECURITY_PROTOCOL_MAP"].split(",")
    )
    controller = env["KAFKA_CONTROLLER_LISTENER_NAMES"]
    assert set(bound) == set(protocols), "every listener needs a security protocol"
    assert controller in bound
    assert controller not in advertised, "the controller listener is not for clients"
    assert set(advertised) <= set(bound)
    for name, (_host, port) in advertised.items():
        assert bound[name][1] == port, f"{name} advertises another port than it binds"
    assert env["KAFKA_INTER_BROKER_LISTENER_NAME"] in advertised
    [voter] = env["KAFKA_CONTROLLER_QUORUM_VOTERS"].split(",")
    node, _, address = voter.partition("@")
    assert node == env["KAFKA_NODE_ID"]
    assert address == f"{kafka['hostname']}:{bound[controller][1]}"
    for setting in (
        "KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR",
        "KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR",
        "KAFKA_TRANSACTION_STATE_LOG_MIN_ISR",
    ):
        assert env[setting] == "1", f"{setting} must be 1 on a single broker"
    # What the host reaches is what the broker advertises to the host.
    host_listeners = [n for n, (h, _p) in advertised.items() if h == "localhost"]
    for name in host_listeners:
        port = advertised[name][1]
        assert published_ports(kafka).get(port) == port
    health = " ".join(kafka["healthcheck"]["test"])
    assert "kafka-broker-api-versions.sh" in health or "kafka-topics.sh" in health
    internal_port = advertised[env["KAFKA_INTER_BROKER_LISTENER_NAME"]][1]
    assert f"localhost:{internal_port}" in health


def test_compose_relay_reaches_kafka_through_the_advertised_container_listener() -> None:
    kafka_env = environment(service("kafka"))
    advertised = listeners(kafka_env["KAFKA_ADVERTISED_LISTENERS"])
    host, port = advertised[kafka_env["KAFKA_INTER_BROKER_LISTENER_NAME"]]
    relay_env = environment(service("relay"))
    assert relay_env["OUTBOX_KAFKA_BOOTSTRAP_SERVERS"] == f"{host}:{port}"
    if kafka_env.get("KAFKA_AUTO_CREATE_TOPICS_ENABLE") == "false":
        assert int(relay_env["OUTBOX_CREATE_TOPICS"]) >= 1, "nobody would create the topics"


@pytest.mark.parametrize("name", ["migrate", "relay", "orders"])
def test_compose_database_url_points_at_the_postgres_service(name: str) -> None:
    pg_env = environment(service("postgres"))
    url = urlsplit(environment(service(name))["OUTBOX_DATABASE_URL"])
    assert url.scheme.startswith("postgresql")
    assert url.hostname == "postgres"
    assert (url.port or 5432) == 5432
    assert url.username == pg_env["POSTGRES_USER"]
    assert url.password == pg_env["POSTGRES_PASSWORD"]
    assert url.path.lstrip("/") == pg_env["POSTGRES_DB"]


def test_compose_relay_is_built_here_and_waits_for_its_dependencies() -> None:
    relay = service("relay")
    assert relay["build"]["context"] == "."
    assert (REPO / relay["build"].get("dockerfile", "Dockerfile")).is_file()
    assert relay.get("command", ["relay"]) == ["relay"]
    conditions = {name: dep["condition"] for name, dep in relay["depends_on"].items()}
    assert conditions == {
        "postgres": "service_healthy",
        "kafka": "service_healthy",
        "migrate": "service_completed_successfully",
    }


def test_compose_relay_serves_metrics_on_the_image_port() -> None:
    relay = service("relay")
    env = environment(relay)
    port = int(env["OUTBOX_METRICS_PORT"])
    assert port == exposed_port()
    assert env["OUTBOX_METRICS_HOST"] == "0.0.0.0"
    assert published_ports(relay) == {port: port}
    check = compose_healthcheck_command()
    assert "/healthz" in check[-1]
    assert "OUTBOX_METRICS_PORT" in check[-1]


def test_compose_relay_has_time_to_shut_down() -> None:
    relay = service("relay")
    env = environment(relay)
    timeout = float(env.get("OUTBOX_SHUTDOWN_TIMEOUT", default_shutdown_timeout()))
    grace = str(relay.get("stop_grace_period", "10s"))
    assert grace.endswith("s") and grace[:-1].isdigit(), grace
    # The relay exits at the latest FORCED_EXIT_GRACE past its shutdown timeout.
    assert int(grace[:-1]) > timeout + FORCED_EXIT_GRACE


@pytest.mark.parametrize(("name", "command"), [("migrate", "migrate"), ("relay", "relay")])
def test_compose_sets_only_variables_the_cli_knows(name: str, command: str) -> None:
    for variable in environment(service(name)):
        if variable.startswith("OUTBOX_"):
            assert known_variable(variable, command), f"{name}: {variable} is not a setting"


def test_compose_migrate_runs_once_from_the_relay_image() -> None:
    migrate = service("migrate")
    assert migrate["command"] == ["migrate"]
    assert migrate["image"] == service("relay")["image"]
    assert migrate["build"] == service("relay")["build"]
    assert migrate["restart"] == "no"
    assert migrate["depends_on"] == {"postgres": {"condition": "service_healthy"}}


def test_compose_orders_service_runs_the_shipped_producer_script() -> None:
    orders = service("orders")
    assert orders["image"] == service("relay")["image"]
    entrypoint = orders["entrypoint"]
    assert entrypoint[0] == "python"
    script = Path(entrypoint[1])
    mounts = bind_mounts(orders)
    assert str(script.parent) in mounts
    assert (mounts[str(script.parent)] / script.name).is_file()
    assert orders["depends_on"] == {"migrate": {"condition": "service_completed_successfully"}}


def test_compose_bind_mounts_exist_in_the_repository() -> None:
    for name, svc in compose()["services"].items():
        for target, source in bind_mounts(svc).items():
            assert source.exists(), f"{name}: {source} (for {target}) does not exist"


def test_compose_prometheus_loads_the_shipped_config() -> None:
    prometheus = service("prometheus")
    flags = dict(arg.split("=", 1) for arg in prometheus["command"] if "=" in arg)
    mounts = bind_mounts(prometheus)
    assert mounts[flags["--config.file"]] == PROMETHEUS_CONFIG
    assert 9090 in published_ports(prometheus)


def grafana_yaml(kind: str) -> dict[str, Any]:
    [path] = sorted((GRAFANA_PROVISIONING / kind).glob("*.yml"))
    document = yaml.safe_load(path.read_text())
    assert isinstance(document, dict)
    return document


def test_compose_grafana_is_provisioned_with_the_datasource_and_dashboard() -> None:
    grafana = service("grafana")
    mounts = bind_mounts(grafana)
    assert mounts["/etc/grafana/provisioning"] == GRAFANA_PROVISIONING
    [provider] = grafana_yaml("dashboards")["providers"]
    assert provider["type"] == "file"
    assert mounts[provider["options"]["path"]] == DASHBOARD.parent
    [datasource] = grafana_yaml("datasources")["datasources"]
    assert datasource["type"] == "prometheus"
    url = urlsplit(datasource["url"])
    assert url.hostname == "prometheus"
    assert url.port in published_ports(service("prometheus"))
    env = environment(grafana)
    assert env["GF_SECURITY_ADMIN_USER"]
    assert env["GF_SECURITY_ADMIN_PASSWORD"]
    assert 3000 in published_ports(grafana)


def test_compose_only_publishes_host_ports_once() -> None:
    host_ports = [
        host for svc in compose()["services"].values() for host in published_ports(svc).values()
    ]
    assert len(host_ports) == len(set(host_ports))
    assert 5432 not in host_ports, "the host's own PostgreSQL usually has 5432"


# --------------------------------------------------------------------------- Prometheus


def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        message = "promtool is missing (Debian package prometheus; .ci/run installs it)"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return found


def test_promtool_accepts_the_prometheus_config() -> None:
    result = subprocess.run(
        [promtool(), "check", "config", str(PROMETHEUS_CONFIG)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout + result.stderr


def test_prometheus_scrapes_the_relay_service_on_its_metrics_port() -> None:
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    [job] = [j for j in config["scrape_configs"] if "relay" in j["job_name"]]
    assert job.get("metrics_path", "/metrics") == "/metrics"
    targets = [t for group in job["static_configs"] for t in group["targets"]]
    port = environment(service("relay"))["OUTBOX_METRICS_PORT"]
    assert targets == [f"relay:{port}"]


# --------------------------------------------------------------------------- Grafana dashboard


def dashboard() -> dict[str, Any]:
    document = json.loads(DASHBOARD.read_text())
    assert isinstance(document, dict)
    return document


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) for every query of every panel."""
    return [
        (panel["title"], target["expr"])
        for panel in dashboard()["panels"]
        for target in panel.get("targets", [])
    ]


def test_the_dashboard_uses_the_provisioned_datasource() -> None:
    [datasource] = grafana_yaml("datasources")["datasources"]
    panels = dashboard()["panels"]
    assert panels
    for panel in panels:
        assert panel["datasource"]["uid"] == datasource["uid"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == datasource["uid"], panel["title"]


def test_the_dashboard_layout_is_well_formed() -> None:
    panels = dashboard()["panels"]
    ids = [panel["id"] for panel in panels]
    assert len(ids) == len(set(ids))
    for panel in panels:
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["w"] > 0 and grid["x"] + grid["w"] <= 24, panel["title"]
        refs = [target["refId"] for target in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]


def test_every_metric_the_dashboard_queries_is_exported_by_the_relay() -> None:
    exported = relay_series()
    for title, expr in dashboard_queries():
        for name in _METRIC_NAME.findall(expr):
            assert name in exported, f"panel {title!r} queries {name}, which no relay exports"


@pytest.mark.parametrize(
    ("needed", "what"),
    [
        (r"\boutbox_pending_events\b", "backlog"),
        (r"\boutbox_oldest_pending_age_seconds\b", "oldest pending age"),
        (r"rate\(outbox_events_published_total\[", "throughput"),
        (r"histogram_quantile\(.*outbox_commit_to_ack_seconds_bucket", "latency"),
        (r"\boutbox_events_retried_total\b", "retries"),
        (r"\boutbox_events_discarded_total\b", "discards"),
        (r"\boutbox_events_held_total\b", "held sends"),
        (r"\boutbox_database_errors_total\b", "database errors"),
        (r"\boutbox_leases_lost_total\b", "leases lost"),
        (r"\boutbox_parked_keys\b", "parked keys"),
    ],
)
def test_the_dashboard_shows(needed: str, what: str) -> None:
    assert any(re.search(needed, expr) for _title, expr in dashboard_queries()), what


def test_every_dashboard_query_is_valid_promql(tmp_path: Path) -> None:
    # promtool parses PromQL in rule files; Grafana's $__rate_interval becomes a duration.
    rules = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [
                    {
                        "record": f"dashboard:query_{n}",
                        "expr": expr.replace("$__rate_interval", "1m"),
                    }
                    for n, (_title, expr) in enumerate(dashboard_queries())
                ],
            }
        ]
    }
    path = tmp_path / "dashboard-rules.yml"
    path.write_text(yaml.safe_dump(rules))
    result = subprocess.run(
        [promtool(), "check", "rules", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{len(rules['groups'][0]['rules'])} rules found" in result.stdout


# --------------------------------------------------------------------------- Kubernetes


def k8s_documents() -> list[dict[str, Any]]:
    documents = []
    for path in sorted(K8S.glob("*.yaml")):
        for document in yaml.safe_load_all(path.read_text()):
            assert isinstance(document, dict), path
            documents.append({**document, "__file__": path.name})
    return documents


def k8s(kind: str) -> dict[str, Any]:
    [found] = [d for d in k8s_documents() if d["kind"] == kind]
    return found


def container(kind: str) -> dict[str, Any]:
    [c] = k8s(kind)["spec"]["template"]["spec"]["containers"]
    return c  # type: ignore[no-any-return]


def container_env(c: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {entry["name"]: entry for entry in c.get("env", [])}


def test_k8s_manifests_parse_and_kustomization_lists_them() -> None:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert kustomization["kind"] == "Kustomization"
    resources = kustomization["resources"]
    for resource in resources:
        assert (K8S / resource).is_file(), resource
    manifests = {d["__file__"] for d in k8s_documents() if d["kind"] != "Kustomization"}
    # The example Secret stays out: applying it would overwrite the real one.
    assert set(resources) == manifests - {"secret.example.yaml"}
    kinds = {d["kind"]: d["apiVersion"] for d in k8s_documents()}
    assert kinds["Deployment"] == "apps/v1"
    assert kinds["Service"] == "v1"
    assert kinds["ServiceMonitor"] == "monitoring.coreos.com/v1"
    assert kinds["Job"] == "batch/v1"
    assert kinds["Secret"] == "v1"
    images = {entry["name"] for entry in kustomization.get("images", [])}
    for kind in ("Deployment", "Job"):
        assert container(kind)["image"].split(":")[0] in images


def test_k8s_kustomize_renders_the_resources() -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed; the manifests are parsed by the other tests")
    result = subprocess.run(
        [kubectl, "kustomize", str(K8S)], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
    rendered = [d for d in yaml.safe_load_all(result.stdout) if d]
    assert sorted(d["kind"] for d in rendered) == ["Deployment", "Job", "Service", "ServiceMonitor"]


def test_k8s_relay_runs_two_replicas_of_the_relay_command() -> None:
    deployment = k8s("Deployment")
    assert deployment["spec"]["replicas"] == 2
    template_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= template_labels.items()
    assert container("Deployment").get("args", ["relay"]) == ["relay"]


def metrics_port(c: dict[str, Any]) -> tuple[str, int]:
    [port] = c["ports"]
    return port["name"], int(port["containerPort"])


def resolve_port(c: dict[str, Any], port: int | str) -> int:
    name, number = metrics_port(c)
    return number if port == name else int(port)


def test_k8s_probes_ask_healthz_and_readyz_on_the_image_port() -> None:
    relay = container("Deployment")
    _name, port = metrics_port(relay)
    assert port == exposed_port()
    env = container_env(relay)
    assert int(env["OUTBOX_METRICS_PORT"]["value"]) == port
    assert env["OUTBOX_METRICS_HOST"]["value"] == "0.0.0.0"
    live = relay["livenessProbe"]["httpGet"]
    ready = relay["readinessProbe"]["httpGet"]
    assert live["path"] == "/healthz"
    assert ready["path"] == "/readyz"
    assert resolve_port(relay, live["port"]) == port
    assert resolve_port(relay, ready["port"]) == port


def test_k8s_pod_annotations_point_prometheus_at_the_metrics_port() -> None:
    annotations = k8s("Deployment")["spec"]["template"]["metadata"]["annotations"]
    _name, port = metrics_port(container("Deployment"))
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == str(port)
    assert annotations["prometheus.io/path"] == "/metrics"


def test_k8s_relay_has_resources_and_time_to_shut_down() -> None:
    relay = container("Deployment")
    for bound in ("requests", "limits"):
        assert set(relay["resources"][bound]) >= {"cpu", "memory"}, bound
    env = container_env(relay)
    timeout = float(env.get("OUTBOX_SHUTDOWN_TIMEOUT", {}).get("value", default_shutdown_timeout()))
    grace = k8s("Deployment")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > timeout + FORCED_EXIT_GRACE


@pytest.mark.parametrize("kind", ["Deployment", "Job"])
def test_k8s_pods_run_as_the_image_user_without_privileges(kind: str) -> None:
    pod = k8s(kind)["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == image_uid()
    assert pod["securityContext"]["runAsUser"] != 0
    security = container(kind)["securityContext"]
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"]["drop"] == ["ALL"]
    assert "add" not in security["capabilities"]


@pytest.mark.parametrize(("kind", "command"), [("Deployment", "relay"), ("Job", "migrate")])
def test_k8s_secrets_come_from_the_secret_and_exist_in_the_example(kind: str, command: str) -> None:
    secret = k8s("Secret")
    keys = set(secret.get("stringData", {})) | set(secret.get("data", {}))
    env = container_env(container(kind))
    assert "valueFrom" in env["OUTBOX_DATABASE_URL"], "the database URL must come from a Secret"
    refs = 0
    for name, entry in env.items():
        assert known_variable(name, command), f"{kind}: {name} is not a {command} setting"
        ref = entry.get("valueFrom", {}).get("secretKeyRef")
        if ref is None:
            assert "value" in entry, name
            continue
        refs += 1
        assert ref["name"] == secret["metadata"]["name"], name
        assert ref["key"] in keys, f"{name}: key {ref['key']} is not in the example Secret"
    assert refs >= 1


def test_k8s_sasl_credentials_are_secret_kafka_settings() -> None:
    env = container_env(container("Deployment"))
    from_secret = {
        name for name, entry in env.items() if "secretKeyRef" in entry.get("valueFrom", {})
    }
    kafka = kafka_config_from_env(dict.fromkeys(from_secret - {"OUTBOX_DATABASE_URL"}, "x"))
    assert set(kafka) == {"sasl.username", "sasl.password"}
    assert set(kafka) <= SECRET_KAFKA_KEYS, "the relay would show these settings"
    plain = kafka_config_from_env({n: e["value"] for n, e in env.items() if "value" in e})
    assert plain["security.protocol"].startswith("SASL")
    assert plain["sasl.mechanism"]


def test_k8s_service_and_servicemonitor_select_the_relay_metrics() -> None:
    svc = k8s("Service")
    pod_labels = k8s("Deployment")["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    _name, port = metrics_port(container("Deployment"))
    [svc_port] = svc["spec"]["ports"]
    assert resolve_port(container("Deployment"), svc_port["targetPort"]) == port
    monitor = k8s("ServiceMonitor")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    [endpoint] = monitor["spec"]["endpoints"]
    assert endpoint["port"] == svc_port["name"]
    assert endpoint.get("path", "/metrics") == "/metrics"
    job_labels = k8s("Job")["spec"]["template"]["metadata"]["labels"]
    assert not svc["spec"]["selector"].items() <= job_labels.items(), "the Service selects the Job"


def test_k8s_migrate_job_runs_migrate_from_the_relay_image() -> None:
    job = k8s("Job")
    migrate = container("Job")
    assert migrate["args"] == ["migrate"]
    assert migrate["image"] == container("Deployment")["image"]
    assert job["spec"]["template"]["spec"]["restartPolicy"] in {"OnFailure", "Never"}
    assert job["spec"]["backoffLimit"] >= 1
