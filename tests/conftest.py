"""Shared fixtures. Each part keeps its fixtures in its own tests/fixtures_*.py; shared ones are re-exported here."""

from tests.fixtures_daemon import off_cluster  # noqa: F401 - autouse: no real kubeconfig reaches any test
from tests.fixtures_dra import dra, dra_api  # noqa: F401
from tests.fixtures_hf import hub_loader  # noqa: F401
from tests.fixtures_s3 import fault_proxy, s3, s3_server  # noqa: F401
