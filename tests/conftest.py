"""Shared fixtures. Each part keeps its fixtures in its own tests/fixtures_*.py; they are re-exported here."""
