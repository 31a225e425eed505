"""Mutating admission webhook: one `weightcache.io/model(s)` annotation gives a pod its model.

`mutate.review` is the whole decision as a pure function on dicts; `server` is the thin aiohttp/TLS adapter,
`certs` makes serving certificates where cert-manager is absent, `command` wires both into the CLI.
"""
