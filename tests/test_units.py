"""One size grammar (Kubernetes quantities) and one byte formatter for the CLI, config and logs."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from weightcache.errors import ConfigError
from weightcache.units import MAX_BYTES, ascii_int, fmt_bytes, parse_size


@pytest.mark.parametrize(("text", "expected"), [
    ("500Gi", 500 * 2**30), ("1.5T", 1_500_000_000_000), ("16Mi", 16 << 20), ("64k", 64_000), (4096, 4096),
    ("4096", 4096), ("2Ki", 2048), ("1M", 10**6), ("1e9", 10**9), (" 8Mi ", 8 << 20), ("0.5", 1), (".5Ki", 512),
    ("7Ei", 7 * 2**60), (0, 0),
])
def test_quantities(text: object, expected: int) -> None:
    assert parse_size(text, "diskBudget") == expected


@pytest.mark.parametrize(("text", "hint"), [
    ("1m", "milli"), ("20GB", "write 20G .* or 20Gi"), ("1K", "write 1k .* or 1Ki"), ("1MiB", "1Mi"),
    ("8Ei", "less than 8Ei"), ("1e99", "less than 8Ei"), (2**64, "less than 8Ei"), (-1, "negative"),
    ("-1Gi", "Kubernetes quantity"), ("5 GB", "Kubernetes quantity"), ("lots", "Kubernetes quantity"),
    ("1" * 65, "65-character value"), (True, "expected a size"), (1.5, "expected a size"), (None, "expected a size"),
])
def test_bad_sizes_say_what_to_write(text: object, hint: str) -> None:
    with pytest.raises(ConfigError, match=f"^diskBudget: .*{hint}"):
        parse_size(text, "diskBudget")


@given(st.integers(min_value=0, max_value=MAX_BYTES))
def test_every_byte_count_round_trips_as_text(n: int) -> None:
    assert parse_size(str(n)) == n


@pytest.mark.parametrize(("n", "text"), [
    (None, "?"), (0, "0 B"), (1023, "1023 B"), (1024, "1 KiB"), (1536, "1.5 KiB"), (16 << 20, "16 MiB"),
    (10**12, "931 GiB"), (3 * 2**40, "3 TiB"), (2**63, "8 EiB"), (2.5 * 2**20, "2.5 MiB"), (1.25 * 2**30, "1.25 GiB"),
    (12.34 * 2**30, "12.3 GiB"), (1023.9 * 2**20, "1024 MiB"), (1000 * 2**10, "1000 KiB"),
])
def test_format_bytes_uses_binary_units(n: float | None, text: str) -> None:
    assert fmt_bytes(n) == text


def test_cli_size_flags_use_the_same_grammar(capsys: pytest.CaptureFixture[str]) -> None:
    from weightcache.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["evict", "--to-size", "200Gi"]).to_size == 200 * 2**30
    assert parser.parse_args(["prefetch", "s3://m/x/", "--chunk-size", "16Mi"]).chunk_size == parse_size("16Mi")
    # unset: the one settings reader decides (file, WEIGHTCACHE_CHUNK_SIZE, then the default of 16 MiB)
    assert parser.parse_args(["prefetch", "s3://m/x/"]).chunk_size is None
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(["prefetch", "s3://m/x/", "--chunk-size", "1m"])
    assert exc.value.code == 2
    assert "milli" in capsys.readouterr().err


@pytest.mark.parametrize(("text", "expected"), [("0", 0), ("120", 120), ("", None), ("-1", None), ("1.5", None),
                                                ("\u00b2", None), ("\u0663", None), (" 1", None)])
def test_ascii_int_reads_ascii_digits_only(text: str, expected: int | None) -> None:
    assert ascii_int(text) == expected
