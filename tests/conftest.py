"""Shared fixtures. Each part keeps its fixtures in its own tests/fixtures_*.py, registered here once: a test names a
fixture as a parameter and imports only the helpers (classes, functions, constants) it calls."""

pytest_plugins = [  # a module another imports comes first, so pytest registers it before the import (assert rewrite)
    "tests.fixtures_s3",
    "tests.fixtures_csi",
    "tests.fixtures_daemon",  # autouse off_cluster: no real kubeconfig reaches any test
    "tests.fixtures_dra",
    "tests.fixtures_hf",
    "tests.fixtures_hub",
    "tests.fixtures_kube",  # apiserver, cluster: the stand-in API server
    "tests.fixtures_registry",  # autouse no_docker_config: no developer's docker credentials reach any test
]
