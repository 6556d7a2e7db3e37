"""What ``benchmarks.gpu.prepare`` carries to a lent GPU: memvit's requirement closure for the device's
Python, less the GPU stack and the device image's packages (benchmarks/gpu/closure.py), and the
wheel folder's pruning and fingerprint (benchmarks/gpu/wheels.py)."""

from __future__ import annotations

from pathlib import Path

from benchmarks.gpu import wheels
from benchmarks.gpu.closure import closure, select, too_old_in_image

# A made-up world: each distribution's Requires-Dist, as importlib.metadata gives them.
WORLD: dict[str, list[str]] = {
    "root": [
        "web>=1",
        "torch>=2.1",
        "old-backport; python_version < '3.12'",  # this machine may be 3.11: the device is 3.12
        "new-only; python_version >= '3.12'",
        "windows-only; sys_platform == 'win32'",
        "tool[fast]",
        "devtool; extra == 'dev'",
        "imagelib>=1.0",
        "freshlib>=4.16",
    ],
    "web": ["helper", "typed>=4.16; python_version < '3.13'", "root"],  # a cycle back to the root
    "helper": ["tool"],
    "tool": ["speedup; extra == 'fast'", "slowdown; extra == 'slow'"],
    "speedup": [],
    "new-only": [],
    "typed": [],
    "torch": ["sympy", "nvidia-cublas"],
    "sympy": ["mpmath"],
    "imagelib": ["imagedep"],  # the image's: its own needs are the image's too
    "imagedep": [],
    "freshlib": ["freshdep"],
    "freshdep": [],
}
HERE = {"typed": "4.16.2", "freshlib": "4.16.0", "imagelib": "9.0.0", "tool": "2.0"}


def requires(name: str) -> list[str] | None:
    return WORLD.get(name)


def test_the_closure_follows_markers_for_the_device_and_extras_asked() -> None:
    found = closure("root", requires=requires)
    assert found.followed == {
        "web", "helper", "typed", "new-only", "tool", "speedup", "imagelib", "imagedep", "freshlib",
        "freshdep",
    }  # fmt: skip
    assert "old-backport" not in found.reached  # python_version < 3.12: not on the device
    assert "windows-only" not in found.reached and "devtool" not in found.reached  # no root extras
    assert "slowdown" not in found.reached  # an extra nobody asked for
    assert found.reached["speedup"].via == "tool"
    assert found.reached["typed"].specifiers == {">=4.16"}
    assert found.missing == set() and "root" not in found.reached


def test_the_gpu_stack_is_reached_but_not_followed() -> None:
    found = closure("root", requires=requires)
    assert "torch" in found.reached and "torch" not in found.followed
    assert not {"sympy", "mpmath", "nvidia-cublas"} & set(found.reached)


def test_extras_asked_later_are_followed_too() -> None:
    # Whichever request comes first, tool's extra brings speedup in: asked again with more extras,
    # a distribution is followed again.
    world = {"r": ["a", "tool[fast]"], "a": ["tool"], **{k: WORLD[k] for k in ("tool", "speedup")}}
    found = closure("r", requires=world.get)
    assert "speedup" in found.followed
    world = {"r": ["tool", "a"], "a": ["tool[fast]"], **{k: WORLD[k] for k in ("tool", "speedup")}}
    assert "speedup" in closure("r", requires=world.get).followed


def test_a_requirement_not_installed_here_is_reported_missing() -> None:
    found = closure("root", requires=lambda n: None if n == "helper" else WORLD.get(n))
    assert found.missing == {"helper"}


def test_too_old_in_image() -> None:
    # A version KINDS.md gives decides; else a floor at this environment's own minor version.
    assert too_old_in_image("numpy", [">=3.0"], "3.1.0")
    assert not too_old_in_image("numpy", [">=1.24"], "2.4.0")
    assert too_old_in_image("typed", [">=4.16"], "4.16.2")
    assert not too_old_in_image("typed", [">=4.8"], "4.16.2")
    assert not too_old_in_image("typed", [""], "4.16.2") and not too_old_in_image("typed", [">=4.16"], None)


def test_selection_leaves_the_image_its_packages_unless_too_old_or_always() -> None:
    chosen = select(
        "root",
        image={"imagelib", "freshlib", "typed", "tool"},
        always={"tool"},
        requires=requires,
        version=HERE.get,
    )
    # imagelib: the image's, with what it needs; freshlib and typed: floors at this environment's
    # minor version, so carried, with what they need; tool: always carried.
    assert chosen.carry == sorted(
        ["web", "helper", "new-only", "tool", "speedup", "freshlib", "freshdep", "typed"]
    )
    assert set(chosen.from_image) == {"imagelib"}
    assert chosen.newer_than_image == {"freshlib", "typed"}


def test_memvits_own_closure_here() -> None:
    chosen = select()
    carried = set(chosen.carry)
    # fastapi's own needs (the hand list missed opentelemetry-api), the server's, and timm pinned.
    assert {"fastapi", "opentelemetry-api", "starlette", "pydantic", "pydantic-core", "uvicorn"} <= carried
    assert {"obstore", "python-multipart", "timm"} <= carried
    # Neither the GPU stack nor what torch needs, nor what the image holds at a version that will do.
    assert not {"torch", "torchvision", "triton", "sympy", "networkx", "jinja2", "filelock"} & carried
    assert not [name for name in carried if name.startswith(("nvidia-", "cuda-"))]
    assert not {"numpy", "pillow", "safetensors", "anyio"} & carried
    assert "memvit" not in carried and not chosen.closure.missing


def test_prune_keeps_one_version_of_each(tmp_path: Path) -> None:
    for name in (
        "fastapi-0.165.0-py3-none-any.whl",
        "fastapi-0.110.0-py3-none-any.whl",
        "typing_extensions-4.16.0-py3-none-any.whl",
        "gone-1.0-py3-none-any.whl",
        "memvit-0.1.0-py3-none-any.whl",
    ):
        (tmp_path / name).write_bytes(b"")
    removed = wheels.prune(tmp_path, {"fastapi": "0.165.0", "typing-extensions": "4.16.0"})
    assert removed == ["fastapi-0.110.0-py3-none-any.whl", "gone-1.0-py3-none-any.whl"]
    assert len(list(tmp_path.glob("*.whl"))) == 3


def test_source_digest_follows_every_source_file(tmp_path: Path) -> None:
    for folder in wheels.MEMVIT_SOURCES:
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "a.py").write_text("x = 1\n")
    first = wheels.source_digest(tmp_path)
    (tmp_path / "server" / "a.py").write_text("x = 2\n")
    assert wheels.source_digest(tmp_path) != first
    (tmp_path / "server" / "a.py").write_text("x = 1\n")
    assert wheels.source_digest(tmp_path) == first
    (tmp_path / "adapters" / "b.py").write_text("")
    assert wheels.source_digest(tmp_path) != first
