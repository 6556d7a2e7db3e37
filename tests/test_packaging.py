"""One installed name: the wheel installs ``memvit`` only, next to PyPI's ``adapters`` (AdapterHub).

The repository keeps its top-level folders (``server/``, ``adapters/``, ``memory_core/``); setuptools'
``package-dir`` installs them as ``memvit.server``, ``memvit.adapters`` and ``memvit.memory_core``.
The end-to-end tests run ``pip install <checkout>`` (``pip install .``) into a fresh venv beside
AdapterHub's ``adapters`` and serve the embedded demo from it, from a directory where the checkout is
not on the path. ``pip install -e .`` is how every other test imports memvit.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from memvit.server.demo import SAMPLES_DIR
from tests.server.launcher import ServerProcess

tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11's tomllib")

REPO = Path(__file__).resolve().parents[1]
FOLDERS = ("server", "adapters", "memory_core")
HUB_ADAPTERS = "adapters"  # AdapterHub's library on PyPI; the name memvit's folder used to install as


def _pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))


def _package_folders() -> set[str]:
    """memvit.<dotted folder> for every folder under server/, adapters/, memory_core/ with an __init__.py."""
    return {
        "memvit." + ".".join(init.parent.relative_to(REPO).parts)
        for folder in FOLDERS
        for init in (REPO / folder).rglob("__init__.py")
        if "__pycache__" not in init.parts
    }


def test_the_package_list_names_every_folder() -> None:
    """pyproject.toml lists the packages by hand (package-dir cannot be discovered): keep it whole."""
    setuptools = _pyproject()["tool"]["setuptools"]
    assert set(setuptools["packages"]) == _package_folders()
    assert setuptools["package-dir"] == {f"memvit.{f}": f for f in FOLDERS}
    assert _pyproject()["project"]["scripts"] == {"memvit": "memvit.server.cli:app"}


@pytest.fixture(scope="module")
def hub_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv with PyPI's ``adapters`` and memvit from ``pip install <checkout>``.

    torch, timm and the rest come from this interpreter's site-packages through a path file, so the
    venv costs seconds instead of a 5 GB torch install; this venv's own editable hook for memvit is
    not carried (a path line does not run that directory's .pth files).
    """
    venv = tmp_path_factory.mktemp("hub") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    deps = [p for p in sys.path if p.endswith("site-packages") and Path(p).is_dir()]
    Path(site, "zz_memvit_test_deps.pth").write_text("\n".join(deps) + "\n", encoding="utf-8")
    hub = subprocess.run(
        [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", HUB_ADAPTERS],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if hub.returncode != 0:
        pytest.skip(
            f"PyPI's {HUB_ADAPTERS!r} could not be installed (no package index?): {hub.stderr[-400:]}"
        )
    subprocess.run(
        [
            str(python),
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--disable-pip-version-check",
            str(REPO),
        ],
        check=True,
        timeout=600,
    )
    return venv


def _installed_files(venv: Path) -> list[str]:
    """The paths memvit's dist-info RECORD lists, relative to site-packages."""
    (record,) = venv.glob("lib/python*/site-packages/memvit-*.dist-info/RECORD")
    return [line.split(",")[0] for line in record.read_text(encoding="utf-8").splitlines() if line]


def test_pip_install_puts_everything_under_memvit(hub_venv: Path) -> None:
    files = _installed_files(hub_venv)
    tops = {f.split("/")[0] for f in files if not f.startswith("../")}  # ../../../bin/memvit: the script
    assert {t for t in tops if not t.endswith(".dist-info")} == {"memvit"}
    assert "memvit/__init__.py" not in files  # a namespace package: nothing of ours at memvit/ itself
    for expected in (
        "memvit/server/cli/__init__.py",
        "memvit/adapters/bundle/format.py",
        "memvit/memory_core/engine/model.py",
        "memvit/server/static/index.html",
        "memvit/server/demo/base.safetensors",
        "memvit/server/demo/MANIFEST.json",
    ):
        assert expected in files, expected


def _clean_env() -> dict[str, str]:
    """This process's environment without anything that puts the checkout on the path."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSAFEPATH")}


def test_memvit_installs_beside_adapterhub(hub_venv: Path, tmp_path: Path) -> None:
    code = (
        "import adapters, memvit.adapters, memvit.server.cli\n"
        "from memvit.memory_core import MemoryViT\n"
        "from memvit.adapters import attach_bundle\n"
        "assert hasattr(adapters, 'AutoAdapterModel'), adapters.__file__\n"  # AdapterHub's, not ours
        "assert 'site-packages' in memvit.adapters.__file__, memvit.adapters.__file__\n"
        "print(adapters.__file__)"
    )
    # The two commands run at once (each imports torch; neither writes anything): 13-17 s -> 8-10 s.
    run = [str(hub_venv / "bin" / "python"), "-c", code]
    both = [
        subprocess.Popen(
            command, cwd=tmp_path, env=_clean_env(), stdout=subprocess.PIPE, stderr=stderr, text=True
        )
        for command, stderr in ((run, subprocess.PIPE), ([str(hub_venv / "bin" / "memvit"), "--help"], None))
    ]
    (out, err), (help_out, _) = (process.communicate(timeout=300) for process in both)
    assert both[0].returncode == 0, err[-2000:]
    assert str(hub_venv) in out
    assert not (Path(out.strip()).parents[1] / "server").exists()  # no bare top-level folder
    assert both[1].returncode == 0 and "serve" in help_out


def test_the_installed_wheel_serves_the_demo(hub_venv: Path, tmp_path: Path) -> None:
    """``memvit serve`` from the installed package alone: demo weights, page and adapters are in it."""
    server = ServerProcess(None, tmp_path / "store", python=str(hub_venv / "bin" / "python"), cwd=tmp_path)
    server.env.pop("PYTHONPATH", None)  # the checkout stays off the path
    server.start(timeout=120)
    try:
        assert "memvit" in httpx.get(f"{server.url}/").text
        sample = sorted(SAMPLES_DIR.glob("*.png"))[0]
        answer = httpx.post(f"{server.url}/classify", files={"image": (sample.name, sample.read_bytes())})
        assert answer.status_code == 200, answer.text
        assert answer.json()["registry"]["adapters"] >= 1
    finally:
        server.stop()
