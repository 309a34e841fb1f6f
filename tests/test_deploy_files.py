"""Offline checks of the deployment files: Dockerfile, docker compose, Kubernetes manifests.

There is no Docker engine or cluster here, so these check what can be checked without one:
- docker-compose.yml (alone and merged with docker-compose.cpu.yml) against the Compose
  Specification's JSON schema, as vendored by check-jsonschema (dev dependency);
- every Kubernetes object against the Kubernetes OpenAPI schemas in strict mode, as vendored
  by kubernetes-validate (dev dependency), for the oldest and newest versions we claim;
- every command a container or health check runs is `epd <subcommand>` from launcher.cli;
- every EPD_* variable is one that epd reads;
- the wiring between files (ports, labels, selectors, metric names, drain vs grace periods);
- the internal token: compose refuses to start without EPD_INTERNAL_TOKEN, every Kubernetes
  workload reads it from the generated Secret, and the NetworkPolicies let only the gateway
  (and workers among themselves where the pipeline needs it) reach the workers.
"""

from __future__ import annotations

import base64
import copy
import importlib.util
import json
import re
import tomllib
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from launcher.cli import SUBCOMMANDS
from launcher.healthcheck import parse_target

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "k8s"
K8S_BASE = K8S / "base"
K8S_CPU = K8S / "overlays" / "cpu"
# Oldest Kubernetes we claim (gRPC probes GA, PDB unhealthyPodEvictionPolicy) and newest vendored.
K8S_VERSIONS = ["1.29.0", "1.37.0"]

WORKERS = {"encoder": 50051, "prefill": 50052, "decode": 50053}
GATEWAY_PORT = 8000

# The variables epd reads (its settings interface) ...
EPD_VARS = {
    "EPD_MODEL", "EPD_SERVED_MODEL_NAME", "EPD_DEVICE", "EPD_DTYPE", "EPD_REDIS_URL", "EPD_HOST",
    "EPD_PORT", "EPD_ADVERTISE_HOST", "EPD_ENCODER_ADDRS", "EPD_PREFILL_ADDRS", "EPD_DECODE_ADDRS",
    "EPD_PLACEMENT", "EPD_KV_MEMORY_MB", "EPD_PREFILL_CHUNK_TOKENS", "EPD_TTFT_SLO_MS",
    "EPD_ITL_SLO_MS", "EPD_DRAIN_TIMEOUT_S", "EPD_METRICS_PORT", "EPD_ADMISSION_QUANTILE",
    "EPD_INTERNAL_TOKEN", "EPD_ALLOW_UNAUTHENTICATED", "EPD_BULK_PORT",
}  # fmt: skip
# ... and one the image's HEALTHCHECK reads, for a bare `docker run` of a worker.
DOCKERFILE_ONLY_VARS = {"EPD_HEALTHCHECK_TARGET"}
# what the compose files are read with: the token is required, as `docker compose` requires it
COMPOSE_ENV = {"EPD_INTERNAL_TOKEN": "0123456789abcdef0123456789abcdef"}
TOKEN_SECRET = "epd-internal-token"
TOKEN_FILE = "internal-token"     # deploy/k8s/base/, created by the user, git-ignored
DECODE_BULK_PORT = 50054


# ----------------------------------------------------------------------------- loading helpers


class _Reset:
    """Compose's `!reset` tag: drop the inherited value when merging."""

    def __repr__(self) -> str:
        return "!reset"


RESET = _Reset()


class _ComposeLoader(yaml.SafeLoader):
    pass


_ComposeLoader.add_constructor("!reset", lambda loader, node: RESET)


def _load_compose(name: str) -> dict[str, Any]:
    return yaml.load((ROOT / name).read_text(), Loader=_ComposeLoader)


_VAR = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?-)([^}]*)|(:?\?)([^}]*))?\}|\$([A-Za-z_][A-Za-z0-9_]*)")


class ComposeInterpolationError(ValueError):
    """`${VAR:?message}` with VAR unset: `docker compose` stops with the message."""


def _interpolate(value: Any, env: dict[str, str]) -> Any:
    """Compose variable interpolation (`${VAR}`, `${VAR:-default}`, `${VAR:?error}`, `$$`) over a loaded document."""
    if isinstance(value, dict):
        return {k: _interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [_interpolate(v, env) for v in value]
    if isinstance(value, str):

        def sub(m: re.Match[str]) -> str:
            if m.group(0) == "$$":
                return "$"
            name = m.group(1) or m.group(6)
            if m.group(4) and not env.get(name):
                raise ComposeInterpolationError(f"required variable {name} is missing a value: {m.group(5)}")
            return env.get(name) or (m.group(3) or "")

        return _VAR.sub(sub, value)
    return value


def _strip_resets(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _strip_resets(v) for k, v in value.items() if v is not RESET}
    if isinstance(value, list):
        return [_strip_resets(v) for v in value if v is not RESET]
    return value


def _merge(base: Any, override: Any) -> Any:
    """Compose file merge for what our override uses: maps merge key by key, `!reset` deletes,
    anything else replaces. (Compose appends some sequences, e.g. ports; the override has none.)"""
    if isinstance(base, dict) and isinstance(override, dict):
        out = dict(base)
        for key, value in override.items():
            if value is RESET:
                out.pop(key, None)
            else:
                out[key] = _merge(base.get(key), value)
        return out
    return copy.deepcopy(override)


def _x_keys_removed(doc: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in doc.items() if not k.startswith("x-")}


@pytest.fixture(scope="module")
def compose_schema() -> jsonschema.Draft202012Validator:
    schema_file = resources.files("check_jsonschema.builtin_schemas.vendor") / "compose-spec.json"
    schema = json.loads(schema_file.read_text())
    return jsonschema.Draft202012Validator(schema)


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return _interpolate(_load_compose("docker-compose.yml"), COMPOSE_ENV)


@pytest.fixture(scope="module")
def compose_cpu() -> dict[str, Any]:
    return _interpolate(_merge(_load_compose("docker-compose.yml"), _load_compose("docker-compose.cpu.yml")), COMPOSE_ENV)


def _k8s_docs(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def _generated_secrets(kustomization: dict[str, Any]) -> list[dict[str, Any]]:
    """What kustomize's `secretGenerator` makes from `files: [KEY=path]`, with a stand-in for each
    file's content (the real file is the user's and is not in the repository)."""
    out = []
    for gen in kustomization.get("secretGenerator", []):
        data = {}
        for entry in gen["files"]:
            key, _, _path = entry.partition("=")
            data[key] = base64.b64encode(b"stand-in-for-the-user's-token").decode()
        labels = gen.get("options", {}).get("labels", {})
        out.append({"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
                    "metadata": {"name": gen["name"], "labels": labels}, "data": data})
    return out


def _k8s_base() -> list[dict[str, Any]]:
    kustomization = yaml.safe_load((K8S_BASE / "kustomization.yaml").read_text())
    docs = [doc for name in kustomization["resources"] for doc in _k8s_docs(K8S_BASE / name)]
    docs += _generated_secrets(kustomization)
    for doc in docs:  # what kustomize's `namespace` and `images` do
        if doc["kind"] != "Namespace":
            doc["metadata"]["namespace"] = kustomization["namespace"]
        _set_images(doc, kustomization["images"])
    return docs


def _set_images(doc: dict[str, Any], images: list[dict[str, str]]) -> None:
    for container in _containers(doc):
        name, _, tag = container["image"].partition(":")
        for rule in images:
            if rule["name"] == name:
                container["image"] = f"{rule.get('newName', name)}:{rule.get('newTag', tag)}"


def _containers(doc: dict[str, Any]) -> list[dict[str, Any]]:
    if doc["kind"] != "Deployment":
        return []
    return doc["spec"]["template"]["spec"]["containers"]


def _json_patch(doc: dict[str, Any], ops: list[dict[str, Any]]) -> None:
    """RFC 6902 add / replace / remove on dict paths (all the overlay uses)."""
    for op in ops:
        *parents, leaf = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
        node: Any = doc
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        if op["op"] == "remove":
            del node[leaf]  # KeyError = the patch no longer matches the base, as in kustomize
        elif op["op"] in ("add", "replace"):
            node[leaf] = op["value"]
        else:
            raise AssertionError(f"unsupported op {op['op']}")


def _k8s_cpu() -> list[dict[str, Any]]:
    """A small `kustomize build overlays/cpu`: images, strategic-merge patches of ConfigMap data,
    JSON 6902 patches with kind + name-regex targets."""
    overlay = yaml.safe_load((K8S_CPU / "kustomization.yaml").read_text())
    assert overlay["resources"] == ["../../base"]
    docs = _k8s_base()
    for doc in docs:
        _set_images(doc, overlay["images"])
    for patch in overlay["patches"]:
        if "path" in patch:
            smp = yaml.safe_load((K8S_CPU / patch["path"]).read_text())
            assert smp["kind"] == "ConfigMap", "this helper merges ConfigMap data only"
            target = next(
                d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == smp["metadata"]["name"]
            )
            target["data"].update(smp["data"])
        else:
            sel = patch["target"]
            hits = [d for d in docs if d["kind"] == sel["kind"] and re.fullmatch(sel["name"], d["metadata"]["name"])]
            assert hits, f"patch target {sel} matches nothing"
            for doc in hits:
                _json_patch(doc, yaml.safe_load(patch["patch"]))
    return docs


def _by_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def _epd_command(argv: list[str]) -> str:
    """Assert argv is `epd <subcommand> ...`; return the subcommand."""
    assert len(argv) >= 2 and argv[0] == "epd", f"not an epd command: {argv}"
    assert argv[1] in SUBCOMMANDS, f"`epd {argv[1]}` is not a subcommand of launcher.cli ({sorted(SUBCOMMANDS)})"
    return argv[1]


def _env_names(text: str) -> set[str]:
    return set(re.findall(r"\bEPD_[A-Z0-9_]+\b", text))


def _used_subcommands() -> set[str]:
    compose = _load_compose("docker-compose.yml")["services"]
    used = {s["command"][1] for s in compose.values() if s["command"][0] == "epd"}
    used |= {s["healthcheck"]["test"][2] for s in compose.values() if s["healthcheck"]["test"][1] == "epd"}
    used |= {c["args"][1] for d in _k8s_base() for c in _containers(d) if c.get("args", [""])[0] == "epd"}
    return used


def test_deploy_subcommands_have_an_entry_point() -> None:
    """Each `epd <sub>` the deploy files run resolves to a module with main(argv) (not imported:
    that would load torch). Skipped for modules that are not written yet."""
    used = _used_subcommands()
    assert used == {*WORKERS, "gateway", "healthcheck"}
    missing = []
    for sub in sorted(used):
        spec = importlib.util.find_spec(SUBCOMMANDS[sub][0])
        if spec is None or spec.origin is None:
            missing.append(sub)
            continue
        assert re.search(r"^def main\(", Path(spec.origin).read_text(), re.M), f"{spec.origin} has no main()"
    if missing:
        pytest.skip(f"modules not written yet for: {', '.join('epd ' + m for m in missing)}")


# ------------------------------------------------------------------------------------ Dockerfile


def _dockerfile() -> list[Any]:
    """The Dockerfile parsed by BuildKit's own parser (the `dockerfile` dev dependency)."""
    import dockerfile

    return list(dockerfile.parse_file(str(ROOT / "Dockerfile")))


def _pyproject_packages() -> list[str]:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return [p.rstrip("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]]


def test_dockerfile_runs_epd_as_non_root_with_health_check() -> None:
    commands = _dockerfile()
    last_stage = max(i for i, c in enumerate(commands) if c.cmd == "FROM")
    runtime = {c.cmd: c for c in commands[last_stage:]}

    assert runtime["CMD"].json, "exec form, so tini is PID 1's parent of epd, not a shell"
    _epd_command(list(runtime["CMD"].value))
    assert runtime["ENTRYPOINT"].value == ("tini", "--"), "tini forwards SIGTERM; k8s must use args, not command"
    assert runtime["USER"].value[0].split(":")[0] not in ("0", "root")

    kind, shell = runtime["HEALTHCHECK"].value
    assert kind == "CMD"
    argv = shell.split()
    assert _epd_command(argv) == "healthcheck"
    default_target = re.fullmatch(r'"\$\{EPD_HEALTHCHECK_TARGET:-([^}]+)\}"', argv[2])
    assert default_target and parse_target(default_target.group(1)).kind == "http"
    assert "8000" in runtime["EXPOSE"].value


def test_dockerfile_build_args_cpu_by_default() -> None:
    args = dict(c.value[0].split("=", 1) for c in _dockerfile() if c.cmd == "ARG")
    assert args["TORCH_INDEX"].endswith("/whl/cpu")
    assert re.fullmatch(r"\d+\.\d+\.\d+", args["TORCH_VERSION"])
    assert args["BASE_IMAGE"].startswith("python:3.1")


def test_image_contains_every_package_and_the_models() -> None:
    copied = {c.value[0].rstrip("/") for c in _dockerfile() if c.cmd == "COPY" and not c.flags}
    dockerignore = (ROOT / ".dockerignore").read_text().splitlines()
    assert "*" in [ln.strip() for ln in dockerignore], ".dockerignore is an allowlist"
    allowed = {ln.strip()[1:].rstrip("/") for ln in dockerignore if ln.startswith("!")}
    for package in _pyproject_packages():
        assert package in copied, f"Dockerfile does not COPY {package}/"
        assert package in allowed, f".dockerignore does not allow {package}/"
    for needed in ("pyproject.toml", "README.md", "models"):
        assert needed in copied and needed in allowed


# ---------------------------------------------------------------------------------- compose


def test_compose_matches_the_compose_spec(compose_schema, compose, compose_cpu) -> None:
    for name, doc in [
        ("docker-compose.yml", compose),
        ("docker-compose.cpu.yml", _strip_resets(_interpolate(_load_compose("docker-compose.cpu.yml"), COMPOSE_ENV))),
        ("docker-compose.yml + docker-compose.cpu.yml", compose_cpu),
    ]:
        errors = sorted(compose_schema.iter_errors(doc), key=lambda e: list(e.path))
        assert not errors, f"{name}: " + "; ".join(f"{'/'.join(map(str, e.path))}: {e.message}" for e in errors)


def test_compose_schema_is_strict_enough_to_catch_typos(compose_schema, compose) -> None:
    broken = copy.deepcopy(compose)
    broken["services"]["decode"]["healthcheck"]["intervall"] = "5s"
    assert not compose_schema.is_valid(broken)


def test_compose_services_and_commands(compose) -> None:
    services = compose["services"]
    assert set(services) == {"redis", *WORKERS, "gateway"}
    for name in (*WORKERS, "gateway"):
        assert _epd_command(services[name]["command"]) == name


def test_compose_health_checks(compose) -> None:
    services = compose["services"]
    for name, service in services.items():
        assert service["healthcheck"]["test"][0] == "CMD", name
    for name, port in WORKERS.items():
        argv = services[name]["healthcheck"]["test"][1:]
        assert _epd_command(argv) == "healthcheck"
        target = parse_target(argv[2])
        assert (target.kind, target.address) == ("grpc", f"127.0.0.1:{port}")
        assert services[name]["environment"]["EPD_PORT"] == str(port)
    argv = services["gateway"]["healthcheck"]["test"][1:]
    assert _epd_command(argv) == "healthcheck"
    assert parse_target(argv[2]).address == f"http://127.0.0.1:{GATEWAY_PORT}/health"
    assert services["gateway"]["environment"]["EPD_PORT"] == str(GATEWAY_PORT)


def test_compose_start_order_waits_for_health(compose) -> None:
    services = compose["services"]
    for name in WORKERS:
        assert services[name]["depends_on"] == {"redis": {"condition": "service_healthy"}}
    assert services["gateway"]["depends_on"] == {dep: {"condition": "service_healthy"} for dep in ("redis", *WORKERS)}


@pytest.mark.parametrize("which", ["gpu", "cpu"])
def test_compose_workers_can_scale(which, compose, compose_cpu) -> None:
    services = (compose if which == "gpu" else compose_cpu)["services"]
    for name in WORKERS:
        service = services[name]
        assert "ports" not in service and "container_name" not in service, f"{name} cannot --scale"
        assert "EPD_ADVERTISE_HOST" not in service["environment"], "each replica advertises its own IP"
        assert service["environment"]["EPD_REDIS_URL"] == "redis://redis:6379/0"
        assert service["environment"]["EPD_HOST"] == "0.0.0.0"
    assert "container_name" not in services["gateway"]


def test_compose_gpu_reservations_and_cpu_override(compose, compose_cpu) -> None:
    for name in WORKERS:
        devices = compose["services"][name]["deploy"]["resources"]["reservations"]["devices"]
        assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
        assert compose["services"][name]["environment"]["EPD_DEVICE"] == "cuda"

        cpu = compose_cpu["services"][name]
        assert "devices" not in cpu.get("deploy", {}).get("resources", {}).get("reservations", {})
        assert cpu["environment"]["EPD_DEVICE"] == "cpu"
        assert cpu["environment"]["EPD_DTYPE"] == "float32"
        assert cpu["environment"]["EPD_PORT"] == str(WORKERS[name]), "override must merge, not replace, env"
    for name in (*WORKERS, "gateway"):
        assert compose["services"][name]["image"] == "epd:cuda"
        assert compose["services"][name]["build"]["args"]["TORCH_INDEX"].endswith("/whl/cu128")
        assert compose_cpu["services"][name]["image"] == "epd:cpu"
        assert compose_cpu["services"][name]["build"]["args"]["TORCH_INDEX"].endswith("/whl/cpu")
        assert compose_cpu["services"][name]["build"]["context"] == "."
    assert "deploy" not in compose["services"]["gateway"]


def test_compose_redis_is_a_bounded_lru_cache(compose) -> None:
    command = compose["services"]["redis"]["command"]
    assert command[command.index("--maxmemory") + 1] == "256mb"
    assert command[command.index("--maxmemory-policy") + 1] == "allkeys-lru"


def _seconds(duration: str) -> int:
    match = re.fullmatch(r"(?:(\d+)m)?(?:(\d+)s)?", duration)
    assert match and duration, duration
    return int(match.group(1) or 0) * 60 + int(match.group(2) or 0)


def test_compose_stop_grace_outlasts_the_drain(compose) -> None:
    for name in (*WORKERS, "gateway"):
        service = compose["services"][name]
        assert _seconds(service["stop_grace_period"]) > int(service["environment"]["EPD_DRAIN_TIMEOUT_S"])


def test_compose_env_passthrough_matches_epd_serve() -> None:
    # Null entries are passed only when set in the shell, so epd's defaults apply otherwise.
    raw = _load_compose("docker-compose.yml")["x-epd-env"]
    for name, value in raw.items():
        if value is None or name in ("EPD_REDIS_URL", "EPD_HOST"):
            continue
        if name == "EPD_INTERNAL_TOKEN":  # required: no default, compose stops without it
            assert value.startswith(f"${{{name}:?"), value
            continue
        assert value.startswith(f"${{{name}:-"), f"{name} must pass through from the shell: {value}"


def test_compose_needs_the_internal_token_and_gives_it_to_every_service(compose) -> None:
    with pytest.raises(ComposeInterpolationError, match="EPD_INTERNAL_TOKEN"):
        _interpolate(_load_compose("docker-compose.yml"), {})
    for name in (*WORKERS, "gateway"):
        assert compose["services"][name]["environment"]["EPD_INTERNAL_TOKEN"] == COMPOSE_ENV["EPD_INTERNAL_TOKEN"]
    assert "EPD_INTERNAL_TOKEN" not in json.dumps(compose["services"]["redis"])
    assert re.search(r"^\.env$", (ROOT / ".gitignore").read_text(), re.M), ".env holds the token: never commit it"


# ---------------------------------------------------------------------------- environment


@pytest.mark.parametrize(
    "path",
    [
        "docker-compose.yml",
        "docker-compose.cpu.yml",
        "Dockerfile",
        *[str(p.relative_to(ROOT)) for p in sorted(K8S.rglob("*.yaml"))],
    ],
)
def test_only_known_epd_variables(path: str) -> None:
    allowed = EPD_VARS | (DOCKERFILE_ONLY_VARS if path == "Dockerfile" else set())
    unknown = _env_names((ROOT / path).read_text()) - allowed
    assert not unknown, f"{path} uses EPD_ variables epd does not read: {sorted(unknown)}"


# ------------------------------------------------------------------------------- kubernetes


def test_kustomization_lists_every_manifest() -> None:
    kustomization = yaml.safe_load((K8S_BASE / "kustomization.yaml").read_text())
    on_disk = {p.name for p in K8S_BASE.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kustomization["resources"]) == on_disk


@pytest.fixture(scope="module")
def k8s_validate():
    import kubernetes_validate  # dev dependency: vendored Kubernetes schemas

    return kubernetes_validate


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("build", ["base", "overlays/cpu"])
def test_k8s_objects_match_the_kubernetes_schemas(k8s_validate, build: str, version: str) -> None:
    docs = _k8s_base() if build == "base" else _k8s_cpu()
    failures = []
    for doc in docs:
        try:
            k8s_validate.validate(doc, version, strict=True)
        except k8s_validate.ValidationError as exc:
            where = "/".join(map(str, exc.path))
            failures.append(f"{doc['kind']}/{doc['metadata']['name']}: {where}: {exc.message}")
        except k8s_validate.SchemaNotFoundError as exc:
            failures.append(exc.message)
    assert not failures, "\n".join(failures)


def test_k8s_schema_is_strict_enough_to_catch_typos(k8s_validate) -> None:
    decode = copy.deepcopy(_by_kind(_k8s_base(), "Deployment")["decode"])
    decode["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {"grpc": {"port": 50053}}
    with pytest.raises(k8s_validate.ValidationError):
        k8s_validate.validate(decode, K8S_VERSIONS[0], strict=True)


def test_k8s_one_deployment_and_service_per_stage() -> None:
    docs = _k8s_base()
    deployments, services = _by_kind(docs, "Deployment"), _by_kind(docs, "Service")
    assert set(deployments) == set(services) == {"redis", *WORKERS, "gateway"}
    for name, deployment in deployments.items():
        pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
        selector = deployment["spec"]["selector"]["matchLabels"]
        assert selector.items() <= pod_labels.items()
        assert services[name]["spec"]["selector"] == selector
        port_names = {p["name"] for c in _containers(deployment) for p in c["ports"]}
        for port in services[name]["spec"]["ports"]:
            assert port["targetPort"] in port_names, f"service {name} targets a port the pod lacks"


def test_k8s_commands_and_env() -> None:
    docs = _k8s_base()
    config_maps = _by_kind(docs, "ConfigMap")
    assert config_maps["epd-config"]["data"]["EPD_REDIS_URL"] == "redis://redis:6379/0"
    for name, deployment in _by_kind(docs, "Deployment").items():
        if name == "redis":
            continue
        (container,) = _containers(deployment)
        assert "command" not in container, "`command` would replace the image's tini entrypoint"
        assert _epd_command(container["args"]) == name
        assert container["image"] == "epd:cuda"
        env = {e["name"]: e for e in container["env"]}
        expected_port = WORKERS.get(name, GATEWAY_PORT)
        assert env["EPD_PORT"]["value"] == str(expected_port)
        assert expected_port in {p["containerPort"] for p in container["ports"]}
        for source in container["envFrom"]:
            assert source["configMapRef"]["name"] in config_maps
        if name in WORKERS:
            assert env["EPD_ADVERTISE_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"


def test_k8s_workers_probe_grpc_health_and_request_a_gpu() -> None:
    deployments = _by_kind(_k8s_base(), "Deployment")
    for name, port in WORKERS.items():
        (container,) = _containers(deployments[name])
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["grpc"]["port"] == port, f"{name} {probe}"
        assert container["resources"]["requests"]["nvidia.com/gpu"] == 1
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    (gateway,) = _containers(deployments["gateway"])
    assert gateway["readinessProbe"]["httpGet"]["path"] == "/health"
    assert "livenessProbe" in gateway


def test_k8s_pods_run_as_the_image_user() -> None:
    for name, deployment in _by_kind(_k8s_base(), "Deployment").items():
        pod = deployment["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        if name != "redis":
            assert pod["securityContext"]["runAsUser"] == 10001  # Dockerfile's useradd --uid
        for container in pod["containers"]:
            assert container["securityContext"]["allowPrivilegeEscalation"] is False


def test_k8s_termination_grace_outlasts_the_drain() -> None:
    deployments = _by_kind(_k8s_base(), "Deployment")
    for name in (*WORKERS, "gateway"):
        pod = deployments[name]["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        drain = int({e["name"]: e for e in container["env"]}["EPD_DRAIN_TIMEOUT_S"]["value"])
        assert pod["terminationGracePeriodSeconds"] >= drain + 15, name
    decode_drain = int(
        {e["name"]: e for e in _containers(deployments["decode"])[0]["env"]}["EPD_DRAIN_TIMEOUT_S"]["value"]
    )
    assert decode_drain >= 120, "decode drains whole generations"


def test_k8s_autoscaler_per_stage_on_its_queue() -> None:
    docs = _k8s_base()
    hpas, deployments = _by_kind(docs, "HorizontalPodAutoscaler"), _by_kind(docs, "Deployment")
    assert set(hpas) == set(WORKERS)
    adapter = yaml.safe_load((K8S / "prometheus-adapter-values.yaml").read_text())
    (rule,) = adapter["rules"]["external"]
    for stage, hpa in hpas.items():
        assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": stage}
        assert "replicas" not in deployments[stage]["spec"], "the HPA owns the replica count"
        (metric,) = hpa["spec"]["metrics"]
        assert metric["type"] == "External"
        assert metric["external"]["metric"]["name"] == rule["name"]["as"]
        assert metric["external"]["metric"]["selector"]["matchLabels"] == {"stage": stage}
        assert metric["external"]["target"]["type"] == "AverageValue"
        assert hpa["spec"]["minReplicas"] >= 1 and hpa["spec"]["maxReplicas"] > hpa["spec"]["minReplicas"]
    assert rule["seriesQuery"].startswith("epd:queue_depth{")


def test_k8s_disruption_budget_per_stage() -> None:
    docs = _k8s_base()
    pdbs, deployments = _by_kind(docs, "PodDisruptionBudget"), _by_kind(docs, "Deployment")
    assert set(pdbs) == {*WORKERS, "gateway"}
    for name, pdb in pdbs.items():
        assert pdb["spec"]["selector"]["matchLabels"] == deployments[name]["spec"]["selector"]["matchLabels"]
    assert pdbs["decode"]["spec"]["maxUnavailable"] == 1


def test_k8s_cpu_overlay_drops_gpus() -> None:
    docs = _k8s_cpu()
    assert "nvidia.com/gpu" not in json.dumps(docs)
    config = _by_kind(docs, "ConfigMap")["epd-config"]["data"]
    assert (config["EPD_DEVICE"], config["EPD_DTYPE"]) == ("cpu", "float32")
    assert config["EPD_REDIS_URL"] == "redis://redis:6379/0", "overlay merges into the base config"
    for name in (*WORKERS, "gateway"):
        assert _containers(_by_kind(docs, "Deployment")[name])[0]["image"] == "epd:cpu"


def test_redis_is_a_bounded_lru_cache_in_k8s_too() -> None:
    (redis,) = _containers(_by_kind(_k8s_base(), "Deployment")["redis"])
    args = redis["args"]
    assert args[args.index("--maxmemory-policy") + 1] == "allkeys-lru"
    maxmemory = int(args[args.index("--maxmemory") + 1].removesuffix("mb"))
    assert maxmemory < int(redis["resources"]["limits"]["memory"].removesuffix("Mi"))


# ---------------------------------------------------------------------- internal token, network


def test_k8s_token_comes_from_a_generated_secret_that_is_never_committed() -> None:
    kustomization = yaml.safe_load((K8S_BASE / "kustomization.yaml").read_text())
    (generator,) = kustomization["secretGenerator"]
    assert generator["name"] == TOKEN_SECRET
    assert generator["files"] == [f"EPD_INTERNAL_TOKEN={TOKEN_FILE}"]
    assert f"deploy/k8s/base/{TOKEN_FILE}" in (ROOT / ".gitignore").read_text().splitlines()
    assert "*" in (ROOT / ".dockerignore").read_text().splitlines(), "the image copies an allowlist only"
    for build in (_k8s_base(), _k8s_cpu()):
        assert "EPD_INTERNAL_TOKEN" not in json.dumps(_by_kind(build, "ConfigMap"))
        for name, deployment in _by_kind(build, "Deployment").items():
            (container,) = _containers(deployment)
            env = {e["name"]: e for e in container.get("env", [])}
            if name == "redis":
                assert "EPD_INTERNAL_TOKEN" not in env
                continue
            token = env["EPD_INTERNAL_TOKEN"]
            assert "value" not in token, f"{name}: a literal token in a manifest"
            assert token["valueFrom"] == {"secretKeyRef": {"name": TOKEN_SECRET, "key": "EPD_INTERNAL_TOKEN"}}, name
        assert set(_by_kind(build, "Secret")) == {TOKEN_SECRET}


def test_k8s_decode_bulk_port_is_fixed_and_named() -> None:
    (decode,) = _containers(_by_kind(_k8s_base(), "Deployment")["decode"])
    env = {e["name"]: e for e in decode["env"]}
    assert env["EPD_BULK_PORT"]["value"] == str(DECODE_BULK_PORT)
    assert {"name": "kv-bulk", "containerPort": DECODE_BULK_PORT} in decode["ports"]


def test_k8s_workers_serve_metrics_where_they_are_scraped() -> None:
    docs = _k8s_base()
    assert _by_kind(docs, "ConfigMap")["epd-config"]["data"]["EPD_METRICS_PORT"] == "9100"
    for name in WORKERS:
        deployment = _by_kind(docs, "Deployment")[name]
        assert deployment["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] == "9100"
        assert {"name": "metrics", "containerPort": 9100} in _containers(deployment)[0]["ports"]


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    assert set(selector) <= {"matchLabels"}, "this check reads matchLabels only"
    return selector.get("matchLabels", {}).items() <= labels.items()


def _peer_matches(peer: dict[str, Any], source: tuple[str, dict[str, str]], namespace: str) -> bool:
    src_namespace, src_labels = source
    assert set(peer) <= {"podSelector", "namespaceSelector"}, f"unsupported peer {peer}"
    if "namespaceSelector" in peer:
        if not _selects(peer["namespaceSelector"], {"kubernetes.io/metadata.name": src_namespace}):
            return False
    elif src_namespace != namespace:
        return False
    return _selects(peer.get("podSelector", {}), src_labels)


def _ingress_allowed(docs: list[dict[str, Any]], source: tuple[str, dict[str, str]], target: str, port: str) -> bool:
    """NetworkPolicy semantics for one TCP connection to a named container port of `target`'s pods."""
    deployment = _by_kind(docs, "Deployment")[target]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    numbers = {p["name"]: p["containerPort"] for c in _containers(deployment) for p in c["ports"]}
    assert port in numbers, f"{target} has no port {port}"
    namespace = deployment["metadata"]["namespace"]
    policies = [d for d in docs if d["kind"] == "NetworkPolicy" and _selects(d["spec"]["podSelector"], labels)
                and "Ingress" in d["spec"]["policyTypes"]]
    if not policies:
        return True
    for policy in policies:
        for rule in policy["spec"].get("ingress", []):
            ports = rule.get("ports")
            if ports is not None and not any(p["port"] in (port, numbers[port]) for p in ports):
                continue
            peers = rule.get("from")
            if peers is None or any(_peer_matches(peer, source, namespace) for peer in peers):
                return True
    return False


def test_k8s_network_policy_lets_only_the_pipeline_reach_the_workers() -> None:
    for docs in (_k8s_base(), _k8s_cpu()):
        deployments = _by_kind(docs, "Deployment")
        pods = {name: ("epd", d["spec"]["template"]["metadata"]["labels"]) for name, d in deployments.items()}
        sources = {**pods, "stranger-in-namespace": ("epd", {"app": "debug"}), "other-namespace": ("default", {}),
                   "monitoring": ("monitoring", {"app.kubernetes.io/name": "prometheus"})}
        opened = {
            ("gateway", "encoder", "grpc"), ("gateway", "prefill", "grpc"), ("gateway", "decode", "grpc"),
            ("prefill", "encoder", "grpc"), ("decode", "encoder", "grpc"),          # embeddings by key
            ("prefill", "decode", "grpc"), ("prefill", "decode", "kv-bulk"),        # the KV handoff
            *((src, "redis", "redis") for src in (*WORKERS, "gateway", "redis")),
            *(("monitoring", worker, "metrics") for worker in WORKERS),
            *((src, "gateway", "http") for src in sources),                          # the front door
        }
        targets = {**{w: ["grpc", "metrics"] for w in WORKERS}, "redis": ["redis"], "gateway": ["http"]}
        targets["decode"].append("kv-bulk")
        for source, where in sources.items():
            for target, ports in targets.items():
                for port in ports:
                    expected = (source, target, port) in opened
                    assert _ingress_allowed(docs, where, target, port) == expected, (source, target, port)
