# memvit: one frozen ViT plus hot-loaded memory adapters, served as one fused pass.
#
#   docker build -t memvit:latest .                          # python:3.11-slim-bookworm from a registry
#   docker build --build-arg TORCH_VARIANT=cpu -t memvit:cpu .  # CPU-only torch (PyTorch's CPU index)
#   docker/build.sh                                          # offline: stand-in base + local wheelhouse
#
# With nothing configured the container serves the embedded demo; mount a self-describing base at
# /models and set MEMVIT_WEIGHTS to serve your own. Adapters live in the /data/adapters volume.
ARG BASE_IMAGE=python:3.11-slim-bookworm

# ---------------------------------------------------------------------------------------------
FROM ${BASE_IMAGE} AS deps
# Lets docker/build.sh find and remove the build stages' images after a build (the legacy builder
# keeps them as dangling images the size of the whole venv).
LABEL memvit.stage=build
# Build-time pip settings only (a mirror, or a wheelhouse served over HTTP as docker/smoke.sh does);
# an ARG that is not passed is not set, and none of them reaches the runtime stage.
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
ARG PIP_FIND_LINKS
ARG PIP_NO_INDEX
ARG PIP_TRUSTED_HOST
# cuda (default): PyPI's torch, which carries CUDA, so one image serves CPU and GPU hosts (about 6 GB).
# cpu: torch and torchvision from PyTorch's CPU wheel index, for CPU-only hosts (docker/README.md).
ARG TORCH_VARIANT=cuda
ARG TORCH_CPU_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python3 -m venv /opt/venv
WORKDIR /src
# Dependencies first, from the lock, so that a code change does not reinstall torch.
COPY docker/requirements.txt docker/torch-variant.sh docker/
# The CPU index is added only for the cpu variant: on it, 2.x+cpu would satisfy the cuda lock's torch==2.x too.
RUN sh docker/torch-variant.sh "$TORCH_VARIANT" docker/requirements.txt > /tmp/requirements.txt \
    && if [ "$TORCH_VARIANT" = cpu ]; then set -- --extra-index-url "$TORCH_CPU_INDEX_URL"; fi \
    && /opt/venv/bin/pip install "$@" -r /tmp/requirements.txt

# ---------------------------------------------------------------------------------------------
# memvit itself, apart from its dependencies: a code change rebuilds and ships a layer of a few MB,
# not the 6 GB venv, which stays the same layer from one release to the next.
FROM deps AS build
# An ARG belongs to the stage that declares it: pip's settings again, for the build backend.
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
ARG PIP_FIND_LINKS
ARG PIP_NO_INDEX
ARG PIP_TRUSTED_HOST
COPY pyproject.toml README.md ./
COPY memory_core memory_core
COPY adapters adapters
COPY server server
RUN /opt/venv/bin/pip install --no-deps --target /opt/memvit . \
    && PYTHONPATH=/opt/memvit /opt/venv/bin/python -c "from memvit.server.demo import BASE_WEIGHTS; assert BASE_WEIGHTS.is_file(), BASE_WEIGHTS"

# ---------------------------------------------------------------------------------------------
FROM ${BASE_IMAGE}
RUN groupadd --system --gid 10001 memvit \
    && useradd --system --uid 10001 --gid memvit --home-dir /home/memvit --create-home memvit \
    && mkdir -p /data/adapters /models \
    && chown memvit:memvit /data/adapters
COPY --from=deps /opt/venv /opt/venv
COPY --from=build /opt/memvit /opt/memvit
ENV PATH=/opt/memvit/bin:/opt/venv/bin:$PATH \
    PYTHONPATH=/opt/memvit \
    PYTHONUNBUFFERED=1 \
    MEMVIT_HOST=0.0.0.0 \
    MEMVIT_PORT=8000 \
    MEMVIT_ADAPTER_STORE=/data/adapters
USER 10001:10001
WORKDIR /home/memvit
VOLUME ["/data/adapters", "/models"]
EXPOSE 8000
# Healthy means ready: model loaded and adapter store read (GET /readyz answers 200).
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python3", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/readyz' % os.environ.get('MEMVIT_PORT', '8000'), timeout=4)"]
CMD ["memvit", "serve"]
