"""Which wheels a lent GPU machine needs: memvit's installed requirement closure, evaluated for the
device's Python, less the GPU stack and less what the device image already holds.

A hand-kept list drifts: it missed fastapi's own ``opentelemetry-api`` once, and the server step was
skipped on the device for it. The closure is read from the metadata of the packages installed here
(``Requires-Dist``), so it follows whatever versions this environment resolved.
"""

from __future__ import annotations

import importlib.metadata
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from functools import partial

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

# The device's interpreter (KINDS.md: Python 3.12.3 on x86-64 Linux), for evaluating markers here on
# whatever Python builds the wheel folder.
DEVICE_MARKERS: dict[str, str] = {
    "implementation_name": "cpython",
    "implementation_version": "3.12.3",
    "os_name": "posix",
    "platform_machine": "x86_64",
    "platform_python_implementation": "CPython",
    "platform_release": "",
    "platform_system": "Linux",
    "platform_version": "",
    "python_full_version": "3.12.3",
    "python_version": "3.12",
    "sys_platform": "linux",
}
# The device's own GPU stack, built for its driver: never carried, and neither is what it needs
# (sympy, networkx, ... come with the image's torch).
GPU_STACK = frozenset({"torch", "torchvision", "torchaudio", "triton"})
GPU_PREFIXES = ("nvidia-", "cuda-")
# What the device image holds (the Python packages of /work/.library/device/KINDS.md, 'cuda' image),
# as read on this date. Carried only when listed in ALWAYS.
IMAGE_READ = "2026-11-17"
_IMAGE_LIST = """
    absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch
    build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage
    cuda-bindings cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops
    equinox etils execnet filelock flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio
    h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna imageio iniconfig
    interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
    lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown
    markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict
    multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro
    nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft
    nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py
    nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime
    onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint
    packaging pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client propcache
    protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions
    pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil
    pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image
    scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six
    sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore
    threadpoolctl tifffile tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric
    torchmetrics torchvision tqdm transformers treescope triton typer typing-extensions typing-inspect
    urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp
"""
IMAGE_PACKAGES = frozenset(canonicalize_name(name) for name in _IMAGE_LIST.split())
# Carried although the image holds it: the GPU figures must come from the timm the CPU ones did.
ALWAYS = frozenset({"timm"})
# Versions of the image's packages, where KINDS.md's pip-list row gives them (same date).
IMAGE_VERSIONS = {
    "huggingface-hub": "1.33.0",
    "numpy": "2.5.2",
    "safetensors": "0.8.0",
    "torch": "2.11.0",
    "torchvision": "0.26.0",
    "triton": "3.6.0",
}

# A distribution's requirement strings, or None when it is not installed here.
Requires = Callable[[str], "list[str] | None"]


@dataclass
class Reached:
    """One distribution the closure reached: who asked for it first and what was asked of it."""

    via: str
    specifiers: set[str] = field(default_factory=set)
    extras: frozenset[str] = frozenset()


@dataclass
class Closure:
    reached: dict[str, Reached]  # canonical name -> why; the root not counted
    followed: set[str]  # reached and followed (what is carried); the rest stopped where ``stop`` said
    missing: set[str]  # followed but not installed here: no pin, and its own requirements unknown


def installed_requires(name: str) -> list[str] | None:
    """``Requires-Dist`` of the distribution installed here, or None when there is none."""
    try:
        return list(importlib.metadata.distribution(name).requires or [])
    except importlib.metadata.PackageNotFoundError:
        return None


def installed_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def is_gpu_stack(name: str) -> bool:
    key = canonicalize_name(name)
    return key in GPU_STACK or key.startswith(GPU_PREFIXES)


def applies(requirement: Requirement, extras: frozenset[str], env: Mapping[str, str] | None) -> bool:
    """Whether ``requirement`` holds on a machine described by ``env`` (None: this one) for a
    distribution asked with ``extras``."""
    if requirement.marker is None:
        return True
    return any(requirement.marker.evaluate({**(env or {}), "extra": extra}) for extra in extras or {""})


def closure(
    root: str,
    *,
    stop: Callable[[str], bool] = is_gpu_stack,
    requires: Requires = installed_requires,
    env: Mapping[str, str] | None = DEVICE_MARKERS,
) -> Closure:
    """Every distribution ``root`` needs at run time on a device described by ``env`` (none of
    ``root``'s own extras), breadth-first; a distribution for which ``stop`` is true is reached but
    not followed (the device brings it, with whatever it needs). ``env`` None: this machine's markers."""
    root_key = canonicalize_name(root)
    found = Closure({}, set(), set())
    followed: dict[str, frozenset[str]] = {root_key: frozenset()}
    todo: deque[tuple[str, frozenset[str]]] = deque([(root_key, frozenset())])
    while todo:
        key, extras = todo.popleft()
        texts = requires(key)
        if texts is None:
            found.missing.add(key)
            continue
        for text in texts:
            requirement = Requirement(text)
            if not applies(requirement, extras, env):
                continue
            child = canonicalize_name(requirement.name)
            if child == root_key:
                continue
            reached = found.reached.setdefault(child, Reached(via=key))
            reached.specifiers.add(str(requirement.specifier))
            asked = frozenset(requirement.extras)
            reached.extras |= asked
            if stop(child) or (child in followed and asked <= followed[child]):
                continue  # stopped, or nothing new to follow
            # First reached, or asked again with more extras: follow it with all it was asked.
            followed[child] = followed.get(child, frozenset()) | asked
            todo.append((child, followed[child]))
    found.followed = set(followed) - {root_key}
    for reached in found.reached.values():
        reached.specifiers.discard("")
    return found


def too_old_in_image(name: str, specifiers: Iterable[str], here: str | None) -> bool:
    """Whether the image's copy of ``name`` may not satisfy ``specifiers``: where KINDS.md gives its
    version, whether that version fails them; where not, whether one asks for at least a release of
    this environment's own minor version (``here``): the image lags this environment (torch 2.11
    there), so a floor that recent is likely above what it holds."""
    spec = SpecifierSet(",".join(specifiers))
    known = IMAGE_VERSIONS.get(canonicalize_name(name))
    if known is not None:
        return not spec.contains(known, prereleases=True)
    if here is None:
        return False
    minor = Version(here).release[:2]
    floors = (s for s in spec if s.operator in (">=", ">", "==", "~=", "==="))
    return any(Version(s.version).release[:2] >= minor for s in floors)


def _stopped(image: frozenset[str], name: str) -> bool:
    return is_gpu_stack(name) or name in image


@dataclass
class Selection:
    carry: list[str]  # canonical names, sorted: the wheels to download (memvit's own aside)
    closure: Closure
    from_image: dict[str, Reached]  # left to the device image
    newer_than_image: set[str]  # image packages carried anyway (``too_old_in_image``)


def select(
    root: str = "memvit",
    *,
    image: Iterable[str] = IMAGE_PACKAGES,
    always: Iterable[str] = ALWAYS,
    requires: Requires = installed_requires,
    version: Callable[[str], str | None] = installed_version,
    env: Mapping[str, str] = DEVICE_MARKERS,
) -> Selection:
    """What to carry: ``root``'s closure, followed into neither the GPU stack nor the image's packages
    (their own needs are the image's), except ``always`` and image packages ``too_old_in_image``."""
    left = {canonicalize_name(n) for n in image} - {canonicalize_name(n) for n in always}
    while True:  # carrying an image package follows its requirements too: until nothing changes
        found = closure(root, stop=partial(_stopped, frozenset(left)), requires=requires, env=env)
        newer = {
            k for k, r in found.reached.items() if k in left and too_old_in_image(k, r.specifiers, version(k))
        }
        if not newer:
            break
        left -= newer
    carried_image = {k for k in found.followed if k in {canonicalize_name(n) for n in image}}
    return Selection(
        carry=sorted(found.followed),
        closure=found,
        from_image={
            k: r for k, r in found.reached.items() if k not in found.followed and not is_gpu_stack(k)
        },
        newer_than_image=carried_image - {canonicalize_name(n) for n in always},
    )
