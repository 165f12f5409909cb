"""The deployments: the compose stack, the images and the Kubernetes manifests, checked statically
(no Docker engine or cluster here), and what they serve checked for real in the local Triton."""

from __future__ import annotations

import fnmatch
import json
import os
import re
import secrets
import shlex
import shutil
import subprocess
import sys
import time
import tomllib
import urllib.error
import urllib.request
from pathlib import Path, PurePosixPath

import jsonschema
import kubernetes_validate
import numpy as np
import promql_parser
import pytest
import typer
import yaml

from restricted_triton import assert_restricted_to, cmdlines, wait_ready

from scorestack import schema
from conftest import LocalTriton
from scorestack.serve.environment import RUNTIME_REQUIREMENTS_FILE, SERVER_REQUIREMENTS, TRITON_WHEEL, read_requirements, requirements_hash
from scorestack.serve.security import ADMIN_KEY_ENV, ADMIN_KEY_FILE_ENV, ADMIN_KEY_HEADER, KEY_FD_ENV, KEY_PLACEHOLDER_ENV, RESTRICTED_APIS, AdminKey

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"
TEST_KEY = "deploy-test-key-0123456789abcdef"
# What the compose tests give as the host's key file (compose only names it: nothing reads it).
TEST_KEY_FILE = "/home/operator/.config/scorestack/admin.key"
TRITON_DIR = ROOT / "deploy" / "triton"
ENTRYPOINT = TRITON_DIR / "entrypoint.sh"
# Where the compose secret and the Kubernetes Secret volume put the key inside the containers.
COMPOSE_KEY_PATH = "/run/secrets/scorestack_admin_key"
# The Kubernetes API versions the manifests must validate against: an older supported one and the
# newest that kubernetes-validate bundles.
K8S_VERSIONS = ("1.29.0", kubernetes_validate.latest_version())
# Facts of the official Triton releases (NVIDIA's release notes and the server's build.py): the
# Triton core each container carries and the Python its Python backend runs.
TRITON_CONTAINERS = {"24.10": ("2.51.0", "3.10"), "24.11": ("2.52.0", "3.12")}
LOCAL_TRITON = "2.51.0"  # in nvidia-pytriton 0.7.0 (docs/platform-notes.md)


# --- helpers --------------------------------------------------------------------------------------

_VAR = re.compile(r"\$(?:\$|\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\})")


def interpolate(value: object, env: dict[str, str]) -> object:
    """Compose's variable interpolation for the forms the stack uses: ${V}, ${V:-d}, ${V-d}, ${V:?e}, ${V?e}, $$."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        name, op, arg = m.group("name"), m.group("op"), m.group("arg")
        have = env.get(name)
        unset = have is None or (op is not None and op.startswith(":") and have == "")
        if op is not None and op.endswith("?") and unset:
            raise ValueError(f"required variable {name} is missing a value: {arg}")
        if op is not None and op.endswith("-") and unset:
            return arg
        return have or ""

    return _VAR.sub(sub, value)


def compose(env: dict[str, str] | None = None) -> dict:
    raw = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    return interpolate(raw, {ADMIN_KEY_FILE_ENV: TEST_KEY_FILE} if env is None else env)  # type: ignore[return-value]


def scorestack_commands(entrypoint: list[str] | None, command: list[str] | str) -> list[list[str]]:
    """The scorestack argument lists a service or container runs (through `sh -c` where it globs)."""
    cmd = [command] if isinstance(command, str) else list(command)
    if entrypoint in (["sh", "-c"], ["/bin/sh", "-c"]):
        script = " ".join(cmd)
        runs = [shlex.split(part) for part in script.split("&&")]
        assert all(r and r[0] == "scorestack" for r in runs), f"a shell step that is not scorestack: {script}"
        return [r[1:] for r in runs]
    assert entrypoint in (None, ["scorestack"]), entrypoint
    return [cmd]


def parse_cli(argv: list[str]) -> list[str]:
    """Parse argv with the real `scorestack` command line (types, required options, choices), without
    running it; return the sub-command path."""
    from scorestack.cli import app

    cmd = typer.main.get_command(app)
    ctx = cmd.make_context("scorestack", list(argv))
    path: list[str] = []
    while hasattr(cmd, "resolve_command"):  # a group (typer ships its own copy of click)
        # What the group's invoke() resolves next (typer.core.TyperGroup.invoke).
        rest = [*ctx._protected_args, *ctx.args]
        if not rest:
            assert cmd.invoke_without_command, f"`scorestack {' '.join(path)}` needs a sub-command"
            break
        name, sub, args = cmd.resolve_command(ctx, rest)
        assert sub is not None, f"no scorestack command {rest[0]!r}"
        path.append(name)
        ctx = sub.make_context(name, args, parent=ctx)
        cmd = sub
    return path


# typer's own click: the parser's usage errors (a misspelled flag, a bad value).
UsageError = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "UsageError")


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", path.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            op, _, rest = line.partition(" ")
            out.append((op.upper(), rest.strip()))
    return out


def dockerignored(rel: str) -> bool:
    patterns = [p.strip() for p in (ROOT / ".dockerignore").read_text().splitlines() if p.strip() and not p.startswith("#")]
    parts = PurePosixPath(rel).parts
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    return any(fnmatch.fnmatch(p, pat) or fnmatch.fnmatch(p, pat.removeprefix("**/")) for pat in patterns for p in prefixes)


def pinned(image: str) -> bool:
    name, _, tag = image.rpartition(":")
    return bool(name) and "/" not in tag and tag not in ("", "latest") and bool(re.search(r"\d", tag))


def k8s_documents() -> dict[str, list[dict]]:
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    return {name: [d for d in yaml.safe_load_all((K8S / name).read_text()) if d] for name in kust["resources"]}


def pod_specs(docs: list[dict]) -> list[dict]:
    specs = []
    for d in docs:
        if d["kind"] in ("Deployment", "Job"):
            specs.append(d["spec"]["template"]["spec"])
    return specs


def host_port(mapping: str) -> tuple[str, int, int]:
    ip, host, container = mapping.split(":")
    return ip, int(host), int(container)


# --- one source of truth for the runtime's pins -------------------------------------------------------


def test_triton_image_installs_exactly_the_server_environments_pins():
    pins = read_requirements(RUNTIME_REQUIREMENTS_FILE)
    assert SERVER_REQUIREMENTS == (TRITON_WHEEL, *pins)
    assert requirements_hash() == requirements_hash(("nvidia-pytriton==0.7.0", "numpy==1.26.4", "onnxruntime==1.31.1", "scikit-learn==1.9.1", "xgboost-cpu==3.2.0", "lightgbm==4.6.0", "tl2cgen==1.0.0", "threadpoolctl==3.8.0"))
    assert all(re.fullmatch(r"[A-Za-z0-9_.\-]+==[0-9][A-Za-z0-9.]*", p) for p in pins), pins
    assert not any(p.startswith("nvidia-pytriton") for p in pins), "the official image has tritonserver"

    steps = dockerfile_instructions(ROOT / "deploy" / "triton" / "Dockerfile")
    rel = RUNTIME_REQUIREMENTS_FILE.relative_to(ROOT).as_posix()
    copies = [rest.split() for op, rest in steps if op == "COPY"]
    assert [rel, "/opt/scorestack/runtime-requirements.txt"] in copies
    assert not dockerignored(rel)
    installs = [rest for op, rest in steps if op == "RUN" and "pip install" in rest]
    assert len(installs) == 1 and "-r /opt/scorestack/runtime-requirements.txt" in installs[0]
    # Nothing else is pip-installed by name: the file is the only list.
    assert not re.search(r"pip install[^&]*\b[a-z-]+==", installs[0])


def test_triton_base_image_runs_the_runtime_pins():
    *builders, base = [rest for op, rest in dockerfile_instructions(ROOT / "deploy" / "triton" / "Dockerfile") if op == "FROM"]
    assert builders == ["python:3.11.7-slim-bookworm AS keyshim"], builders  # the key-handoff library's build stage
    m = re.fullmatch(r"nvcr\.io/nvidia/tritonserver:(\d\d\.\d\d)-py3", base)
    assert m, f"the Triton image must be an official tritonserver release, pinned: {base}"
    release = m.group(1)
    triton, python = TRITON_CONTAINERS[release]

    def resolves(python_version: str) -> subprocess.CompletedProcess:
        platforms = [f"--platform=manylinux_2_{minor}_x86_64" for minor in range(17, 40)] + ["--platform=manylinux2014_x86_64"]
        cmd = [
            sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet", "--only-binary=:all:",
            f"--python-version={python_version}", "--implementation=cp", *platforms, "--target", "/nonexistent", "-r", str(RUNTIME_REQUIREMENTS_FILE),
        ]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=180)

    # The pins resolve for the image's Python (binary wheels only, as in the image build) ...
    ok = resolves(python)
    assert ok.returncode == 0, f"runtime pins do not install on Triton {release}'s Python {python}:\n{ok.stderr[-2000:]}"
    # ... and do not for the release of the local server's Triton core (why it is not pinned).
    if triton != LOCAL_TRITON:
        local_release = next(r for r, (t, _) in TRITON_CONTAINERS.items() if t == LOCAL_TRITON)
        bad = resolves(TRITON_CONTAINERS[local_release][1])
        assert bad.returncode != 0 and "onnxruntime==1.31.1" in bad.stderr, bad.stderr[-2000:]


def test_scorestack_image():
    steps = dockerfile_instructions(ROOT / "Dockerfile")
    froms = [rest for op, rest in steps if op == "FROM"]
    assert froms and all(pinned(f) and "slim" in f for f in froms), froms
    assert ("ENTRYPOINT", '["scorestack"]') in steps
    users = [rest for op, rest in steps if op == "USER"]
    assert users and users[-1] not in ("root", "0")
    for op, rest in steps:
        if op == "COPY":
            *sources, _ = rest.split()
            for src in sources:
                assert (ROOT / src).exists() and not dockerignored(src.rstrip("/")), src
    run = " ".join(rest for op, rest in steps if op == "RUN")
    assert 'torch==2.13.0' in run and "whl/cpu" in run, "torch must be the pinned CPU build"
    assert "scorestack server-env" in run, "compile verifies in the server environment: it must be in the image"
    # compile copies the native backend library from $SCORESTACK_HOME (root's in the image) into
    # TL2cgen models: it is built at image build time, as the server environment is.
    assert "from scorestack.serve import native; print(native.library())" in run
    assert ("ENV", "PYTHONDONTWRITEBYTECODE=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 SCORESTACK_HOME=/opt/scorestack SCORESTACK_SERVER_ENV=/opt/scorestack/server-env") in [
        (op, " ".join(rest.split())) for op, rest in steps
    ]
    # The Triton image stays on the official image's non-root user.
    assert ("USER", "triton-server") in dockerfile_instructions(ROOT / "deploy" / "triton" / "Dockerfile")


def _lock():
    sys.path.insert(0, str(ROOT / "deploy" / "scorestack"))
    try:
        import lock
    finally:
        sys.path.pop(0)
    return lock


def test_scorestack_image_installs_every_distribution_pinned(server_environment):
    lock = _lock()
    steps = dockerfile_instructions(ROOT / "Dockerfile")
    copies = [rest.split() for op, rest in steps if op == "COPY"]
    assert ["deploy/scorestack/constraints.txt", "deploy/scorestack/server-env-constraints.txt", "/opt/scorestack/"] in copies
    runs = [rest for op, rest in steps if op == "RUN" and "pip install" in rest]
    # torch alone from the CPU index, without its dependencies (they come pinned from PyPI) ...
    (torch_run,) = [r for r in runs if "whl/cpu" in r]
    assert "--no-deps" in torch_run
    pins = lock.read(lock.CONSTRAINTS)
    server = lock.read(lock.SERVER_CONSTRAINTS)
    assert f'"torch=={pins["torch"]}"' in torch_run
    # ... then the project under the constraints, and the server environment under its own.
    (project_run,) = [r for r in runs if "whl/cpu" not in r]
    assert "pip install -c /opt/scorestack/constraints.txt ." in project_run
    assert "PIP_CONSTRAINT=/opt/scorestack/server-env-constraints.txt scorestack server-env" in project_run
    assert project_run.count("pip check") == 2

    # The pins are the project's own where it pins, and the runtime's (one source of truth).
    from packaging.requirements import Requirement

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    for line in project:
        req = Requirement(line)
        name = lock._canon(req.name)
        assert req.specifier.contains(pins[name], prereleases=True) or name == "torch", f"{name}: {pins[name]} vs {req.specifier}"
    assert pins["torch"].split("+")[0] == "2.13.0"
    for req in map(Requirement, SERVER_REQUIREMENTS):
        (spec,) = req.specifier
        assert server[lock._canon(req.name)] == spec.version, req
    # Equal to the environments the tests ran in: the image holds what was tested.
    assert lock.project_pins() == pins, "deploy/scorestack/constraints.txt is stale: run .venv/bin/python deploy/scorestack/lock.py"
    assert lock.server_pins(server_environment.python) == server, "deploy/scorestack/server-env-constraints.txt is stale: run .venv/bin/python deploy/scorestack/lock.py"
    assert {"feast", "numpy", "onnx", "typer", "redis", "grpcio"} <= set(pins) and {"nvidia-pytriton", "numpy", "grpcio"} <= set(server)
    assert pins["numpy"].startswith("2.") and server["numpy"].startswith("1.")
    for path in (lock.CONSTRAINTS, lock.SERVER_CONSTRAINTS):
        assert not dockerignored(path.relative_to(ROOT).as_posix())


# --- the compose stack ------------------------------------------------------------------------------------


def test_compose_file_is_valid_against_the_compose_spec():
    spec = json.loads((ROOT / "deploy" / "schema" / "compose-spec.json").read_text())
    doc = compose()
    validator = jsonschema.Draft7Validator(spec)  # the schema's "$schema" is draft-07
    validator.validate(doc)
    # The validator is live: a misspelled service key is refused.
    broken = json.loads(json.dumps(doc))
    broken["services"]["triton"]["helthcheck"] = broken["services"]["triton"].pop("healthcheck")
    with pytest.raises(jsonschema.ValidationError, match="helthcheck"):
        validator.validate(broken)


def test_compose_config_with_debians_docker_compose(tmp_path):
    """The real Compose implementation (Debian 12's docker-compose 1.29.2) parses, interpolates and
    checks the file; no Docker engine is needed for `config`."""
    exe = shutil.which("docker-compose")
    assert exe, "Debian's docker-compose is not installed: apt-get install docker-compose"
    profiles = ["--profile", "demo", "--profile", "gpu", "--profile", "train"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("SCORESTACK_")}

    def config(*args: str, key: str | None = TEST_KEY_FILE) -> subprocess.CompletedProcess:
        extra = {ADMIN_KEY_FILE_ENV: key} if key is not None else {}
        return subprocess.run([exe, "--project-directory", str(ROOT), "-f", str(ROOT / "docker-compose.yml"), *profiles, "config", *args],
                              capture_output=True, text=True, timeout=120, env={**env, **extra}, cwd=ROOT)

    ok = config()
    assert ok.returncode == 0, ok.stderr
    rendered = yaml.safe_load(ok.stdout)
    assert set(rendered["services"]) == set(compose()["services"])
    assert rendered["services"]["triton"]["depends_on"]["compile"]["condition"] == "service_completed_successfully"
    # The key as a file secret, mounted where the services' SCORESTACK_ADMIN_KEY_FILE points; in no command.
    assert rendered["secrets"] == {"scorestack_admin_key": {"file": TEST_KEY_FILE}}
    for name in ("triton", "triton-gpu", "demo"):
        svc = rendered["services"][name]
        assert svc["secrets"] == [{"source": "scorestack_admin_key"}] and svc["environment"][ADMIN_KEY_FILE_ENV] == COMPOSE_KEY_PATH, name
        assert not any("restricted" in a or ADMIN_KEY_HEADER in a for a in svc["command"]), name
    # Its interpolation: every port on 127.0.0.1, Triton's on the clients' defaults.
    for name, svc in rendered["services"].items():
        for port in svc.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), (name, port)
    assert rendered["services"]["triton"]["ports"] == ["127.0.0.1:8000:8000/tcp", "127.0.0.1:8001:8001/tcp", "127.0.0.1:8002:8002/tcp"]
    # Without the key it refuses, naming the variable.
    bad = config(key=None)
    assert bad.returncode != 0 and "set SCORESTACK_ADMIN_KEY_FILE to a file holding the admin key" in bad.stderr, bad.stderr
    # The real parser is live: a misspelled service key is refused.
    broken = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    broken["services"]["triton"]["helthcheck"] = broken["services"]["triton"].pop("healthcheck")
    tmp = tmp_path / "docker-compose.yml"
    tmp.write_text(yaml.safe_dump(broken))
    out = subprocess.run([exe, "--project-directory", str(ROOT), "-f", str(tmp), "config", "-q"], capture_output=True, text=True, timeout=120, env={**env, ADMIN_KEY_FILE_ENV: TEST_KEY_FILE})
    assert out.returncode != 0 and "helthcheck" in out.stderr, out.stderr


def test_compose_documents_a_demo_run_prometheus_can_find():
    """Prometheus finds the demo's metrics by the service name, which a `docker compose run`
    container has only with --use-aliases: the documented command must pass it."""
    prom = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in prom["scrape_configs"]}
    (sd,) = jobs["scorestack-demo"]["dns_sd_configs"]
    assert sd["names"] == ["demo"]
    s = compose()["services"]
    argv = s["demo"]["command"]
    assert argv[argv.index("--metrics-port") + 1] == str(sd["port"]) and argv[argv.index("--metrics-address") + 1] == "0.0.0.0"
    header = [line for line in (ROOT / "docker-compose.yml").read_text().splitlines() if line.startswith("#   docker compose")]
    runs = [shlex.split(line[1:].split("#")[0]) for line in header if " run " in line]
    (demo,) = [r for r in runs if r[-1] == "demo"]
    assert "--use-aliases" in demo, demo


def test_compose_refuses_to_start_without_an_admin_key_and_holds_no_secret():
    with pytest.raises(ValueError, match="SCORESTACK_ADMIN_KEY_FILE"):
        compose(env={})
    text = (ROOT / "docker-compose.yml").read_text()
    assert TEST_KEY not in text and f"{ADMIN_KEY_HEADER}=" not in text
    doc = compose()
    assert doc["secrets"] == {"scorestack_admin_key": {"file": TEST_KEY_FILE}}
    services = doc["services"]
    # The key is in no command and no environment value (`ps` and `docker inspect` show both): the
    # services that use it (Triton restricts its admin APIs to it; the demo reads statistics) get
    # the file, readable through the host user's group.
    for name, svc in services.items():
        env = svc.get("environment", {})
        assert ADMIN_KEY_ENV not in env and not any("restricted" in a for a in _words(svc.get("command", []))), name
        if name in ("triton", "triton-gpu", "demo", "fraud-replicas"):
            assert svc["secrets"] == ["scorestack_admin_key"] and env == {ADMIN_KEY_FILE_ENV: COMPOSE_KEY_PATH}, name
            assert svc["group_add"] == ["1000"], name
        else:
            assert "secrets" not in svc and ADMIN_KEY_FILE_ENV not in env, name
    assert compose({ADMIN_KEY_FILE_ENV: TEST_KEY_FILE, "SCORESTACK_GID": "1234"})["services"]["triton"]["group_add"] == ["1234"]
    # Triton's command is tritonserver's options: the image's entry point adds the restricted-API
    # flags (test_triton_entrypoint_* below run it).
    for name in ("triton", "triton-gpu"):
        assert services[name]["command"][0] == "tritonserver" and "build" in services[name], name


def test_compose_services_order_and_health():
    s = compose()["services"]
    assert {"compile", "features", "triton", "redis", "prometheus", "demo", "triton-gpu", "train"} <= set(s)
    assert s["triton"]["depends_on"]["compile"]["condition"] == "service_completed_successfully"
    assert s["features"]["depends_on"]["redis"]["condition"] == "service_healthy"
    assert s["demo"]["depends_on"] == {"triton": {"condition": "service_healthy"}, "features": {"condition": "service_completed_successfully"}}
    assert s["triton"]["healthcheck"]["test"][-1].endswith("/v2/health/ready")
    assert s["demo"]["profiles"] == ["demo"] and s["triton-gpu"]["profiles"] == ["gpu"]
    (device,) = s["triton-gpu"]["deploy"]["resources"]["reservations"]["devices"]
    assert device["capabilities"] == ["gpu"] and device["driver"] == "nvidia"
    assert "profiles" not in s["triton"] and "profiles" not in s["compile"]
    assert any(a.startswith("--cache-config=local,size=") for a in s["triton"]["command"])


def test_compose_images_are_pinned_or_built_from_pinned_bases():
    for name, svc in compose()["services"].items():
        assert "image" in svc and pinned(svc["image"]), f"{name}: {svc.get('image')}"
        if "build" in svc:
            for op, rest in dockerfile_instructions(ROOT / svc["build"]["context"] / svc["build"]["dockerfile"]):
                if op == "FROM":
                    assert pinned(rest.split()[0]), f"{name}: FROM {rest}"


def test_compose_ports_are_loopback_and_the_clients_defaults():
    s = compose()["services"]
    for name, svc in s.items():
        for mapping in svc.get("ports", []):
            assert host_port(mapping)[0] == "127.0.0.1", f"{name}: {mapping} is not bound to 127.0.0.1 by default"
    opened = compose({ADMIN_KEY_FILE_ENV: TEST_KEY_FILE, "SCORESTACK_BIND": "0.0.0.0"})["services"]
    assert host_port(opened["triton"]["ports"][0])[0] == "0.0.0.0"

    triton = {c: h for _, h, c in map(host_port, s["triton"]["ports"])}
    assert triton == {8000: 8000, 8001: 8001, 8002: 8002}
    # The defaults the command line documents: the clients' gRPC address and Feast's Redis.
    from scorestack.cli import app

    root = typer.main.get_command(app)
    diagnose_url = next(p for p in root.commands["diagnose"].params if p.name == "url").help
    redis_help = next(p for p in root.commands["features"].commands["apply"].params if p.name == "redis_url").help
    assert f"127.0.0.1:{triton[8001]}" in diagnose_url
    (redis,) = [host_port(p) for p in s["redis"]["ports"]]
    assert f"127.0.0.1:{redis[1]}" in redis_help and redis[2] == 6379
    assert {"triton:8001", "redis://redis:6379/0"} <= {a for svc in s.values() for a in _words(svc.get("command", []))}
    prom = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in prom["scrape_configs"]}
    assert jobs["triton"]["static_configs"][0]["targets"] == [f"triton:{triton[8002]}"]
    assert "./deploy/prometheus.yml:/etc/prometheus/prometheus.yml:ro" in s["prometheus"]["volumes"]


def _words(command: list[str] | str) -> list[str]:
    return [w for part in ([command] if isinstance(command, str) else command) for w in shlex.split(part)]


def test_compose_commands_are_real_scorestack_commands():
    seen = set()
    for _name, svc in compose()["services"].items():
        if svc.get("image", "").split(":")[0] != "scorestack":
            continue
        for argv in scorestack_commands(svc.get("entrypoint"), svc["command"]):
            seen.add(" ".join(parse_cli(argv)))
    assert seen == {"compile", "features apply", "features materialize", "demo train", "demo diagnose"}
    # A wrong flag is caught by the same parser.
    with pytest.raises(UsageError, match="repositry"):
        parse_cli(["compile", "/specs/a.yaml", "--repositry", "/x"])


def test_compose_compile_writes_the_repository_triton_mounts():
    s = compose()["services"]
    (argv,) = scorestack_commands(s["compile"]["entrypoint"], s["compile"]["command"])
    repository = PurePosixPath(argv[argv.index("--repository") + 1])
    # compile stages beside the repository and installs by rename: the repository's parent must be
    # inside the same bind mount.
    mounts = {PurePosixPath(v.split(":")[1]): v.split(":")[0] for v in s["compile"]["volumes"]}
    mount = next(m for m in mounts if repository.parent == m or m in repository.parent.parents)
    host = PurePosixPath(mounts[mount]) / repository.relative_to(mount)
    (triton_mount,) = [v for v in s["triton"]["volumes"] if v.split(":")[1] == "/models"]
    assert PurePosixPath(triton_mount.split(":")[0]) == host == PurePosixPath("model_repository")
    assert triton_mount.endswith(":ro")
    assert "--model-repository=/models" in s["triton"]["command"]
    assert s["features"]["volumes"] == s["demo"]["volumes"] == ["features:/features"]
    assert "/features/feature_repo" in _words(s["demo"]["command"])


# --- Kubernetes ----------------------------------------------------------------------------------------


def test_k8s_manifests_validate_against_the_kubernetes_api():
    docs = k8s_documents()
    assert set(docs) == {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}, "every manifest is in the kustomization"
    kinds = set()
    for _name, items in docs.items():
        for d in items:
            kinds.add(d["kind"])
            for version in K8S_VERSIONS:
                kubernetes_validate.validate(d, version, strict=True)
    assert {"Deployment", "Service", "HorizontalPodAutoscaler", "Job", "PersistentVolumeClaim"} <= kinds
    assert "Secret" not in kinds, "the admin key Secret is created by the operator, never committed"
    # The validator is live: a misspelled field is refused.
    deployment = next(d for d in docs["triton.yaml"] if d["kind"] == "Deployment")
    broken = json.loads(json.dumps(deployment))
    broken["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = broken["spec"]["template"]["spec"]["containers"][0].pop("readinessProbe")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSIONS[-1], strict=True)


def test_k8s_triton_deployment():
    docs = k8s_documents()
    deployment = next(d for d in docs["triton.yaml"] if d["kind"] == "Deployment")
    service = next(d for d in docs["triton.yaml"] if d["kind"] == "Service")
    pod = deployment["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"http": 8000, "grpc": 8001, "metrics": 8002}
    assert {p["port"] for p in service["spec"]["ports"]} == {8000, 8001, 8002}
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    assert c["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert c["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
    assert c["startupProbe"]["httpGet"]["path"] == "/v2/health/ready"
    # The key: the Secret scorestack-admin-key mounted as a file that SCORESTACK_ADMIN_KEY_FILE names,
    # readable by Triton's user only (root-owned, group fsGroup, 0440); in no args and no env value.
    assert c["env"] == [{"name": ADMIN_KEY_FILE_ENV, "value": "/run/secrets/scorestack/key"}]
    assert not any("restricted" in a or ADMIN_KEY_HEADER in a for a in c["args"])
    (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == "/run/secrets/scorestack"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert mount["readOnly"] is True
    assert volume["secret"] == {"secretName": "scorestack-admin-key", "items": [{"key": "key", "path": "key"}], "defaultMode": 0o440}
    assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsUser"] == 1000
    assert "command" not in c, "the image's entry point (entrypoint.sh) must run, it adds the restricted-API flags"
    assert c["args"][0] == "tritonserver" and "--model-repository=/models" in c["args"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    # Compose and Kubernetes run Triton with the same flags, and take the key the same way.
    assert c["args"] == compose()["services"]["triton"]["command"]


def test_k8s_images_are_pinned_and_commands_real():
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    tags = {i["name"]: i["newTag"] for i in kust["images"]}
    for name, items in k8s_documents().items():
        for pod in pod_specs(items):
            for c in pod["containers"]:
                image = c["image"] if ":" in c["image"] else f"{c['image']}:{tags.get(c['image'], '')}"
                assert pinned(image), f"{name}: {c['image']}"
                if c["image"] == "scorestack":
                    for argv in scorestack_commands(c.get("command"), c["args"]):
                        parse_cli(argv)
    assert tags == {"scorestack": "0.1.0", "scorestack-triton": "0.1.0"}


def test_k8s_compile_job_writes_the_repository_triton_reads():
    docs = k8s_documents()
    (job,) = docs["compile-job.yaml"]
    pod = job["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    (argv,) = scorestack_commands(c["command"], c["args"])
    repository = PurePosixPath(argv[argv.index("--repository") + 1])
    claims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"] if "persistentVolumeClaim" in v}
    (mount,) = [m for m in c["volumeMounts"] if PurePosixPath(m["mountPath"]) == repository.parent]
    deployment = next(d for d in docs["triton.yaml"] if d["kind"] == "Deployment")
    tpod = deployment["spec"]["template"]["spec"]
    (tm,) = [m for m in tpod["containers"][0]["volumeMounts"] if m["mountPath"] == "/models"]
    tclaims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in tpod["volumes"] if "persistentVolumeClaim" in v}
    assert tclaims[tm["name"]] == claims[mount["name"]] == "model-repository"
    assert tm["subPath"] == repository.name and tm["readOnly"] is True
    pvc = next(d for d in docs["storage.yaml"] if d["metadata"]["name"] == "model-repository")
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"], "every Triton replica reads it"
    (mjob,) = docs["materialize-job.yaml"]
    (mc,) = mjob["spec"]["template"]["spec"]["containers"]
    assert "redis://redis:6379/0" in mc["args"][0]
    redis_svc = next(d for d in docs["redis.yaml"] if d["kind"] == "Service")
    assert redis_svc["metadata"]["name"] == "redis" and redis_svc["spec"]["ports"][0]["port"] == 6379


def _adapter_rule() -> dict:
    values = yaml.safe_load((K8S / "monitoring" / "prometheus-adapter-values.yaml").read_text())
    (rule,) = values["rules"]["custom"]
    return rule


def _metric_names(query: str) -> set[str]:
    """Metric names a PromQL query selects, from the real parser's syntax tree."""
    expr = promql_parser.parse(query)
    names: set[str] = set()

    def visit(e) -> None:
        if isinstance(e, promql_parser.VectorSelector):
            names.add(e.name)
        for attr in ("expr", "lhs", "rhs", "vector_selector"):
            child = getattr(e, attr, None)
            if isinstance(child, promql_parser.Expr):
                visit(child)
        for arg in getattr(e, "args", None) or []:
            visit(arg)

    visit(expr)
    return names


def _adapter_query(labels: str = 'namespace="scorestack",pod="triton-0"', group_by: str = "pod") -> str:
    return _adapter_rule()["metricsQuery"].replace("<<.LabelMatchers>>", labels).replace("<<.GroupBy>>", group_by)


def test_hpa_reads_the_adapters_metric():
    (hpa,) = k8s_documents()["triton-hpa.yaml"]
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods"
    rule = _adapter_rule()
    assert metric["pods"]["metric"]["name"] == rule["name"]["as"]
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "triton"}
    assert _metric_names(_adapter_query()) == {"nv_inference_queue_duration_us", "nv_inference_request_success"}
    assert _metric_names(rule["seriesQuery"]) == {"nv_inference_queue_duration_us"}
    assert re.fullmatch(rule["name"]["matches"], "nv_inference_queue_duration_us")


# --- the Triton image's entry point: the admin key without a command line --------------------------------


def test_triton_image_builds_the_key_shim_and_runs_the_entrypoint():
    """The image compiles the same C source `scorestack serve` builds (serve/keyshim.c) and puts the library
    and entrypoint.sh where the script looks; its ENTRYPOINT runs the script after NVIDIA's."""
    steps = dockerfile_instructions(TRITON_DIR / "Dockerfile")
    copies = [rest.split() for op, rest in steps if op == "COPY"]
    assert ["serve/keyshim.c", "/src/keyshim.c"] in copies
    assert ("RUN", "gcc -shared -fPIC -O2 -o /src/keyshim.so /src/keyshim.c") in steps
    assert ["--from=keyshim", "/src/keyshim.so", "/opt/scorestack/keyshim.so"] in copies
    assert ["deploy/triton/entrypoint.sh", "/opt/scorestack/entrypoint.sh"] in copies
    for src in ("serve/keyshim.c", "deploy/triton/entrypoint.sh"):
        assert (ROOT / src).is_file() and not dockerignored(src), src
    assert ("ENTRYPOINT", '["/opt/nvidia/nvidia_entrypoint.sh", "/opt/scorestack/entrypoint.sh"]') in steps
    assert any(op == "RUN" and "chmod 0755 /opt/scorestack/entrypoint.sh" in rest for op, rest in steps)
    # The builder installs the compiler (and nothing is pip-installed there).
    builder = steps[: next(i for i, (op, rest) in enumerate(steps) if op == "FROM" and rest.startswith("nvcr.io/"))]
    assert any(op == "RUN" and "apt-get install" in rest and " gcc" in rest for op, rest in builder)
    script = ENTRYPOINT.read_text()
    assert script.startswith("#!/bin/bash\n") and 'SHIM="${SCORESTACK_KEYSHIM:-/opt/scorestack/keyshim.so}"' in script
    assert os.access(ENTRYPOINT, os.X_OK)
    from scorestack.serve.security import key_shim_source

    assert key_shim_source() == (ROOT / "serve" / "keyshim.c").read_text()


def _fake_tritonserver(bin_dir: Path) -> Path:
    """A `tritonserver` that prints what main() gets, what ps shows, and its environment."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    fake = bin_dir / "tritonserver"
    fake.write_text(
        "#!/bin/sh\n"
        'for a in "$@"; do printf "ARG %s\\n" "$a"; done\n'
        'printf "CMDLINE %s\\n" "$(tr "\\0" " " < /proc/$$/cmdline)"\n'
        'tr "\\0" "\\n" < /proc/$$/environ | sed "s/^/ENVIRON /"\n'
        'env | sed "s/^/ENV /"\n'
    )
    fake.chmod(0o755)
    return fake


def _entrypoint(args: list[str], env: dict[str, str], bin_dir: Path) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith("SCORESTACK_")}
    full = {**base, "PATH": f"{bin_dir}:{base.get('PATH', '/usr/bin:/bin')}", **env}
    return subprocess.run(["bash", str(ENTRYPOINT), *args], env=full, capture_output=True, text=True, timeout=30)


def _lines(out: str, tag: str) -> list[str]:
    return [line.removeprefix(tag + " ") for line in out.splitlines() if line.startswith(tag + " ")]


@pytest.fixture(scope="module")
def key_shim(tmp_path_factory) -> Path:
    from scorestack.serve.security import build_key_shim

    return build_key_shim(tmp_path_factory.mktemp("keyshim"))


def test_triton_entrypoint_hands_the_key_over_without_a_command_line(tmp_path, key_shim):
    """entrypoint.sh, run for real with the real library (built from serve/keyshim.c) and a stand-in
    tritonserver: main() gets exactly AdminKey.triton_args(RESTRICTED_APIS); the command line and the
    environment hold only a random placeholder; the key comes from the file or from the env var."""
    fake = _fake_tritonserver(tmp_path / "bin")
    key = AdminKey(secrets.token_urlsafe(32))
    key_file = tmp_path / "admin.key"
    key_file.write_text(f"  {key.value}\n")  # as AdminKey: surrounding whitespace does not count
    key_file.chmod(0o640)
    user_args = ["--model-repository=/models", "--model-control-mode=explicit"]
    want = [*user_args, *key.triton_args(RESTRICTED_APIS)]
    placeholders = set()
    for how, env, args in (
        ("file", {ADMIN_KEY_FILE_ENV: str(key_file)}, ["tritonserver", *user_args]),  # as compose and Kubernetes run it
        ("env", {ADMIN_KEY_ENV: key.value}, user_args),
    ):
        done = _entrypoint(args, {**env, "SCORESTACK_KEYSHIM": str(key_shim), "LD_PRELOAD": "libc.so.6"}, fake.parent)
        assert done.returncode == 0, (how, done.stderr)
        assert _lines(done.stdout, "ARG") == want, how  # what tritonserver's main() parses
        (cmdline,) = _lines(done.stdout, "CMDLINE")  # what ps shows
        placeholder = re.search(r"scorestack-admin-key=(scorestack-key-placeholder-[0-9a-f]{32})( |$)", cmdline).group(1)
        assert cmdline.split()[2:] == [a.replace(key.value, placeholder) for a in want], how
        placeholders.add(placeholder)
        environ, env_after = _lines(done.stdout, "ENVIRON"), _lines(done.stdout, "ENV")
        assert not any(key.value in v for v in environ + env_after + [cmdline]), how
        names = {v.split("=", 1)[0] for v in environ}
        assert not names & {ADMIN_KEY_ENV, ADMIN_KEY_FILE_ENV, "SCORESTACK_KEYSHIM"}, (how, names)
        # The library's variables are gone for children; the caller's LD_PRELOAD stays.
        after = dict(v.split("=", 1) for v in env_after)
        assert KEY_FD_ENV not in after and KEY_PLACEHOLDER_ENV not in after and after["LD_PRELOAD"] == "libc.so.6", (how, after)
        assert key.value not in done.stderr
    assert len(placeholders) == 2, "a new random placeholder each start"


def test_triton_entrypoint_refuses_to_start_without_a_usable_key(tmp_path, key_shim):
    fake = _fake_tritonserver(tmp_path / "bin")
    shim = {"SCORESTACK_KEYSHIM": str(key_shim)}
    key = secrets.token_urlsafe(32)

    def refused(args: list[str], env: dict[str, str]) -> str:
        done = _entrypoint(args, env, fake.parent)
        assert done.returncode == 78 and "ARG" not in done.stdout, (args, env, done.stdout, done.stderr)
        return done.stderr

    assert "no admin key: set SCORESTACK_ADMIN_KEY_FILE" in refused(["--model-repository=/models"], shim)
    assert "does not exist" in refused([], {**shim, ADMIN_KEY_FILE_ENV: str(tmp_path / "missing.key")})
    short = tmp_path / "short.key"
    short.write_text("too-short\n")
    assert "must be at least 16 URL-safe characters" in refused([], {**shim, ADMIN_KEY_FILE_ENV: str(short)})
    assert "must be at least 16 URL-safe characters" in refused([], {**shim, ADMIN_KEY_ENV: "a:b=c" + key})
    assert "set only one" in refused([], {**shim, ADMIN_KEY_ENV: key, ADMIN_KEY_FILE_ENV: str(short)})
    # Without the library Triton would answer to the placeholder ps shows: no start.
    assert "handoff library /nonexistent/keyshim.so is missing" in refused([], {"SCORESTACK_KEYSHIM": "/nonexistent/keyshim.so", ADMIN_KEY_ENV: key})
    not_a_library = tmp_path / "keyshim.so"
    not_a_library.write_text("not an ELF file\n")
    assert f"handoff library {not_a_library} does not load" in refused([], {"SCORESTACK_KEYSHIM": str(not_a_library), ADMIN_KEY_ENV: key})
    # A key on the command line, or another command, is refused too.
    assert "drop '--http-restricted-api' from the command" in refused([f"--http-restricted-api=trace:{ADMIN_KEY_HEADER}={key}"], {**shim, ADMIN_KEY_ENV: key})
    assert "not a command: 'bash'" in refused(["bash"], {**shim, ADMIN_KEY_ENV: key})
    # The explicit opt-out: starts with the admin APIs open, and says so.
    # (The leading word may be tritonserver's path: Triton's entrypoint.d puts it there in Vertex AI mode.)
    done = _entrypoint(["/opt/tritonserver/bin/tritonserver", "--model-repository=/models"], {**shim, "SCORESTACK_ALLOW_OPEN_ADMIN": "1"}, fake.parent)
    assert done.returncode == 0 and _lines(done.stdout, "ARG") == ["--model-repository=/models"], done.stderr
    assert "WARNING: no admin key" in done.stderr


def test_triton_entrypoint_restricts_the_real_tritonserver_to_the_key_file(tmp_path, key_shim, server_environment):
    """entrypoint.sh starting the real tritonserver (the server environment's, standing in for the image's)
    with the key from a file, as compose and Kubernetes give it: the repository API refuses no key and
    the placeholder ps shows, and opens to the key; no process's command line holds the key."""
    from scorestack.serve.ports import free_ports

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "tritonserver").symlink_to(server_environment.tritonserver)
    key = AdminKey(secrets.token_urlsafe(32))
    key_file = tmp_path / "admin.key"
    key_file.write_text(key.value + "\n")
    key_file.chmod(0o640)
    (tmp_path / "models").mkdir()
    h, g, m = free_ports(3)
    env = {k: v for k, v in server_environment.launch_env().items() if not k.startswith("SCORESTACK_")}
    env.update({"PATH": f"{bin_dir}:{env['PATH']}", ADMIN_KEY_FILE_ENV: str(key_file), "SCORESTACK_KEYSHIM": str(key_shim)})
    args = [
        "tritonserver", f"--model-repository={tmp_path / 'models'}", "--model-control-mode=explicit",
        "--http-address=127.0.0.1", f"--http-port={h}", "--grpc-address=127.0.0.1", f"--grpc-port={g}",
        "--metrics-address=127.0.0.1", f"--metrics-port={m}", "--allow-gpu-metrics=false",
    ]
    with open(tmp_path / "tritonserver.log", "wb") as log:
        proc = subprocess.Popen(["bash", str(ENTRYPOINT), *args], env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_ready(h, proc, tmp_path / "tritonserver.log", grpc_port=g, metrics_port=m)
        # The script exec'd tritonserver: same process, whose command line ends with the flags, placeholder in.
        cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes().decode().split("\0")[:-1]
        assert Path(cmdline[0]).name == "tritonserver" and cmdline[1:-2] == args[1:]
        placeholder = cmdline[-1].rpartition("=")[2]
        assert placeholder.startswith("scorestack-key-placeholder-")
        assert cmdline[-2:] == AdminKey(placeholder).triton_args(RESTRICTED_APIS)
        assert [pid for pid, cmd in cmdlines().items() if key.value.encode() in cmd] == []
        environ = Path(f"/proc/{proc.pid}/environ").read_bytes()
        assert key.value.encode() not in environ and f"{ADMIN_KEY_FILE_ENV}=".encode() not in environ
        assert_restricted_to(key, placeholder, h, g)
    finally:
        proc.terminate()
        proc.wait(30)
    assert key.value not in (tmp_path / "tritonserver.log").read_text(errors="replace")


# --- for real: the repository `scorestack compile` writes, served by the local Triton ----------------------

FORMATS = (("fraud_xgb", "onnx"), ("fraud_xgb", "native"), ("fraud_xgb", "tl2cgen"), ("fraud_sklearn", "native"))


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> tuple[Path, Path, dict[str, dict]]:
    """Small demo models, one spec per format the compiler emits, compiled by the command line."""
    from scorestack.demo.train import train_demo_models

    root = tmp_path_factory.mktemp("deploy")
    models = root / "specs"
    train_demo_models(models, xgb_trees=30, sklearn_iters=20, ranker_trees=5, n_fraud=4000, n_queries=60)
    specs = {}
    for source, fmt in FORMATS:
        spec = yaml.safe_load((models / f"{source}.yaml").read_text())
        name = f"{source}_{fmt}"
        spec.update(name=name, formats=[fmt])
        spec["serving"] = dict(spec["serving"], batch_sizes=[1, 64], batch_weights=[0.5, 0.5])
        (models / f"{name}.yaml").write_text(yaml.safe_dump(spec))
        specs[name] = spec
    repository = root / "model_repository"
    # As the compose `compile` service runs it (the serving check is done below, in one Triton).
    cmd = [str(Path(sys.executable).parent / "scorestack"), "compile", *(str(models / f"{n}.yaml") for n in specs), "--repository", str(repository), "--jobs", "2", "--no-serve-check"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "COLUMNS": "200"})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return models, repository, specs


def _reference(models: Path, source: str, X: np.ndarray) -> np.ndarray:
    if source == "fraud_xgb":
        import xgboost as xgb

        booster = xgb.Booster()
        booster.load_model(str(models / "fraud_xgb.json"))
        return booster.predict(xgb.DMatrix(X))
    import joblib

    return joblib.load(models / "fraud_sklearn.joblib").predict_proba(X)[:, 1]


def test_every_format_runs_embedded_and_answers_as_the_source(compiled):
    """scorestack.serve.EmbeddedModels runs every format the compiler emits here (ONNX, native XGBoost, TL2cgen, native
    scikit-learn) on the caller's thread: each reproduced its reference rows at load, and answers held-out rows the
    source model has not seen in its reference, alone and in batches, within the spec's tolerance."""
    from scorestack.serve import EmbeddedModels

    models, repository, specs = compiled
    X = np.load(models / "fraud_holdout.npz")["X"][-200:].astype(np.float32)
    out = schema.OUTPUT_TENSORS["binary"]
    with EmbeddedModels(repository) as embedded:
        assert set(embedded.reference_check()) == set(specs)
        for name, spec in specs.items():
            want = _reference(models, name.rsplit("_", 1)[0], X)
            ones = [embedded.infer(name, [(schema.INPUT_TENSOR, "FP32", X[i : i + 1])], [out])[out] for i in range(20)]
            batches = [embedded.infer(name, [(schema.INPUT_TENSOR, "FP32", X[i : i + 64])], [out])[out] for i in range(0, len(X), 64)]
            tol = spec["verification"]["tolerance"]
            np.testing.assert_allclose(np.concatenate(ones).reshape(-1), want[:20], rtol=0, atol=tol, err_msg=name)
            np.testing.assert_allclose(np.concatenate(batches).reshape(-1), want, rtol=0, atol=tol, err_msg=name)
            assert 0.0 <= embedded.reference_check()[name] <= tol


def _scrape(url: str) -> dict[tuple[str, str], float]:
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        m = re.match(r'^(nv_[a-z_]+)\{([^}]*)\} ([0-9.e+-]+)$', line)
        if m:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
            out[(m.group(1), labels.get("model", ""))] = out.get((m.group(1), labels.get("model", "")), 0.0) + float(m.group(3))
    return out


def _http(server: LocalTriton, path: str, key: AdminKey | None) -> tuple[int, dict]:
    req = urllib.request.Request(f"http://{server.http_url}{path}", headers=key.http_headers if key else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def test_compiled_repository_serves_every_format_and_exports_the_hpa_metric(compiled, server_environment):
    import tritonclient.grpc as grpcclient
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    models, repository, specs = compiled
    backends = {}
    for name in specs:
        folder = repository / name
        cfg = text_format.Parse((folder / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
        backends[name] = cfg.backend
        assert (folder / "1" / "SHA256SUMS").exists() and (folder / "1" / "model.py").exists()
    # ONNX goes to Triton's onnxruntime backend; TL2cgen to scorestack's native backend, whose
    # library the compiler puts in the version folder (Triton looks there first, so the official
    # image needs nothing added for it); native XGBoost and scikit-learn need the runtime's Python
    # dependencies, which the Triton image adds.
    assert backends == {"fraud_xgb_onnx": "onnxruntime", "fraud_xgb_native": "python", "fraud_xgb_tl2cgen": "scorestack", "fraud_sklearn_native": "python"}
    assert (repository / "fraud_xgb_tl2cgen" / "1" / "libtriton_scorestack.so").exists()
    # In the container ONNX runs in Triton's own onnxruntime backend, not the runtime's 1.31: the
    # 24.11 image carries ONNX Runtime 1.19.2, which implements ONNX 1.16 (IR version 10, opset 21).
    import onnx

    onnx_model = onnx.load(str(repository / "fraud_xgb_onnx" / "1" / "model.onnx"))
    opsets = {o.domain or "ai.onnx": o.version for o in onnx_model.opset_import}
    assert onnx_model.ir_version <= 10 and opsets["ai.onnx"] <= 21 and opsets.get("ai.onnx.ml", 1) <= 4, (onnx_model.ir_version, opsets)

    key = AdminKey(TEST_KEY)
    X = np.load(models / "fraud_holdout.npz")["X"][:256].astype(np.float32)
    with LocalTriton(repository, server_env=server_environment, admin_key=key, ready_timeout_s=300) as server:
        assert {n: st.ready for n, st in server.model_status.items()} == {n: True for n in specs}
        before = _scrape(server.metrics_url)
        client = grpcclient.InferenceServerClient(server.grpc_url)
        try:
            for name, spec in specs.items():
                source = name.rsplit("_", 1)[0]
                want = _reference(models, source, X)
                got = []
                for i in range(0, len(X), 16):
                    inp = grpcclient.InferInput(schema.INPUT_TENSOR, [len(X[i : i + 16]), X.shape[1]], "FP32")
                    inp.set_data_from_numpy(np.ascontiguousarray(X[i : i + 16]))
                    res = client.infer(name, [inp], client_timeout=30)  # inference needs no key
                    got.append(res.as_numpy(schema.OUTPUT_TENSORS["binary"]).reshape(-1))
                np.testing.assert_allclose(np.concatenate(got), want, rtol=0, atol=spec["verification"]["tolerance"], err_msg=name)
        finally:
            client.close()
        # Triton counts a request when it releases it, which can come just after the client has its
        # response: read the metrics until the last request is counted (bounded), then compare.
        want_requests = len(range(0, len(X), 16))
        for _ in range(50):
            after = _scrape(server.metrics_url)
            if all(after.get(("nv_inference_request_success", n), 0.0) - before.get(("nv_inference_request_success", n), 0.0) >= want_requests for n in specs):
                break
            time.sleep(0.1)

        # The HPA's inputs exist under these names and mean what the adapter's query assumes:
        # cumulative queue microseconds and successful requests, per model, equal to Triton's own
        # statistics (read with the admin key: refused without it).
        assert _http(server, "/v2/models/fraud_xgb_onnx/stats", None)[0] == 403
        for name in specs:
            requests = after[("nv_inference_request_success", name)] - before.get(("nv_inference_request_success", name), 0.0)
            queue_us = after[("nv_inference_queue_duration_us", name)] - before.get(("nv_inference_queue_duration_us", name), 0.0)
            assert requests == want_requests, name
            status, stats = _http(server, f"/v2/models/{name}/stats", key)
            assert status == 200, stats
            (s,) = [m for m in stats["model_stats"] if m["inference_stats"]["success"]["count"] > 0]
            total_requests = s["inference_stats"]["success"]["count"]
            total_queue_us = s["inference_stats"]["queue"]["ns"] / 1000
            assert after[("nv_inference_request_success", name)] == total_requests  # warm-up is not counted by either
            assert abs(after[("nv_inference_queue_duration_us", name)] - total_queue_us) <= total_requests, name
            assert queue_us >= 0
        scraped = {metric for metric, _ in after}
    assert _metric_names(_adapter_query()) <= scraped
