# syntax=docker/dockerfile:1
# The one image every component runs: the node daemon (with the CSI plugin), the webhook, the CLI.
# No weights inside: models are fetched at run time into the node's store. No torch either: pods that use
# weightcache.loader install `weightcache[torch]` in their own image.
#
# Reproducible: the base is a precise Python release (pin its digest too: docs/operations.md, "Building the
# image"), every dependency is installed from requirements.lock by exact version and sha256 hash (pip refuses
# anything else), nothing comes from apt. Multi-arch (amd64, arm64 for GH200/Grace):
#   docker buildx build --platform linux/amd64,linux/arm64 -t REGISTRY/weightcache:0.2.0 --push .
# Two builds of one commit give one digest when timestamps are clamped (`--timestamp 0` with buildah,
# SOURCE_DATE_EPOCH with BuildKit) and the base is pinned by digest (the release workflow does both).
# Without the public index (scripts/test_image.sh): PYTHON_IMAGE=<a local Debian bookworm + python3 image> and a
# wheelhouse of the locked wheels passed in through pip's own variables (PIP_NO_INDEX=1, PIP_FIND_LINKS=DIR on a
# build volume), or a private index and its CA bundle (PIP_INDEX_URL, PIP_CERT). They reach only the build stage.
ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ARG PIP_INDEX_URL
ARG PIP_FIND_LINKS
ARG PIP_NO_INDEX
ARG PIP_CERT
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1
# python3, not python: Debian's python3 package has no `python` (the official image has both)
RUN python3 -m venv /opt/weightcache
COPY requirements.lock requirements-build.lock /src/
# --only-binary: every locked package ships wheels for both architectures; no compiler in the image
RUN /opt/weightcache/bin/pip install --require-hashes --only-binary :all: -r /src/requirements.lock \
 && /opt/weightcache/bin/pip install --require-hashes --only-binary :all: -r /src/requirements-build.lock
COPY pyproject.toml README.md /src/
COPY weightcache /src/weightcache
# our own package only, built with the locked setuptools: its dependencies are all in the lock above
RUN /opt/weightcache/bin/pip install --no-deps --no-build-isolation /src \
 && /opt/weightcache/bin/pip uninstall -y setuptools pip \
 && find /opt/weightcache -name '__pycache__' -prune -exec rm -rf {} + \
 && /opt/weightcache/bin/python -m compileall -q -j 0 --invalidation-mode unchecked-hash /opt/weightcache/lib
# Bytecode in the image: without it every start compiles each module it imports (PYTHONDONTWRITEBYTECODE keeps
# nothing), 0.1-0.3 CPU s per CLI call. pip's own .pyc files are dropped above (they embed the install time);
# hash-based ones depend only on the source, so the layer stays reproducible, and unchecked: nothing in the
# image changes a source file.

FROM ${PYTHON_IMAGE}
COPY --from=build /opt/weightcache /opt/weightcache
ENV PATH=/opt/weightcache/bin:$PATH \
    WEIGHTCACHE_ROOT=/var/lib/weightcache \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
# The daemon mounts with mount(2) through libc (no util-linux) and handles SIGTERM itself as PID 1; it starts
# no child processes, so no init is needed to reap them.
ENTRYPOINT ["weightcache"]
CMD ["daemon"]
