"""The node daemon: store, fetch engine, HTTP API on a Unix socket, reconcile loop, live config, metrics, CSI.

    app.py          process lifecycle, sockets, signals         node.py       state shared by API, reconcile, CSI
    api.py          aiohttp handlers (parse, delegate, dump)    reconcile.py  desired models -> store (pure core)
    listing.py      GET /v1/models kept until the store changes cluster.py    bridge to weightcache.kube and .csi
    config.py       settings: YAML + env + flags                configwatch   live reload (ConfigMap-aware)
    metrics.py      prometheus registry + scrape collector      tasks.py      named, guarded tasks
    client.py       sync client the CLI uses                    command.py    `weightcache daemon` wiring
    metrics_server  the read-only /metrics port (guarded site)  dra.py        the DRA plugin wired to the node

config.py parses the daemon's fields; the fetch settings and the node name come from weightcache/settings.py,
which the CLI and the standalone CSI server read too. The guarded TCP site is weightcache/listener.py.
"""
