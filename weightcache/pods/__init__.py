"""What a pod says and how it is patched, as pure functions the placement controller and the webhook share:
`annotations` (the `weightcache.io/*` annotations parsed into an Injection) and `patch` (JSON Patch against a
pod). Below both, so neither imports the other's package for them; off the store (a forbidden contract)."""
