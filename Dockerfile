# The one image every component runs: the node daemon (with the CSI plugin), the webhook, the CLI.
# No weights inside: models are fetched at run time into the node's store.
FROM python:3.11-slim-bookworm

# util-linux: mount/umount/findmnt for the CSI plugin's bind mounts; tini reaps and forwards SIGTERM.
RUN apt-get update \
 && apt-get install -y --no-install-recommends util-linux mount tini \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /src
COPY pyproject.toml README.md ./
COPY weightcache ./weightcache
# The daemon needs no torch; pods that use weightcache.loader install `weightcache[torch]` in their own image.
RUN pip install --no-cache-dir . && rm -rf /src

ENV WEIGHTCACHE_ROOT=/var/lib/weightcache \
    PYTHONUNBUFFERED=1
WORKDIR /
ENTRYPOINT ["/usr/bin/tini", "--", "weightcache"]
CMD ["daemon"]
