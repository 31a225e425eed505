"""The daemon's `dra` config key and `--dra` flag: defaults, tuning, and clear errors for bad values."""

from __future__ import annotations

from pathlib import Path

import pytest

from weightcache.daemon.command import flags_of
from weightcache.daemon.config import DraSettings, load_settings, parse_settings
from weightcache.errors import ConfigError


def test_off_by_default_on_with_true_or_a_mapping() -> None:
    assert parse_settings({}).dra is None
    assert parse_settings({"dra": True}).dra == DraSettings()
    assert parse_settings({"dra": "false"}).dra is None
    tuned = parse_settings({"dra": {"slotsPerModel": 16, "shared": True, "cdiDir": "/etc/cdi",
                                    "apiVersion": "v1beta2", "publishSeconds": 5}}).dra
    assert tuned == DraSettings(16, True, Path("/etc/cdi"), "v1beta2", 5.0)


@pytest.mark.parametrize(("value", "message"), [
    ({"slotsPerModel": 0}, "dra.slotsPerModel: expected a whole number >= 1"),
    ({"slotsPerModel": 65}, "at most 64"),
    ({"apiVersion": "v1alpha3"}, "dra.apiVersion: expected one of v1, v1beta2"),
    ({"cdiDir": "cdi"}, "dra.cdiDir: expected an absolute path"),
    ({"publishSeconds": 0}, "dra.publishSeconds"),
    ({"slotsPerModle": 4}, "did you mean 'slotsPerModel'"),
    ([1], "dra: expected true, false or a mapping"),
])
def test_bad_values_name_the_field(value: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        parse_settings({"dra": value})


def test_the_flag_turns_it_on(tmp_path: Path) -> None:
    from weightcache.cli import build_parser

    parser = build_parser()  # `daemon` declares its flags, the settings' own, when it parses
    on = flags_of(parser.parse_args(["daemon", "--dra"]))
    assert load_settings(None, env={}, flags=on).dra == DraSettings()
    off = flags_of(parser.parse_args(["daemon"]))
    assert load_settings(None, env={}, flags=off).dra is None
    config = tmp_path / "config.yaml"
    config.write_text("dra: {slotsPerModel: 3}\n")
    assert load_settings(config, env={}, flags=on).dra == DraSettings(slots_per_model=3)  # the flag keeps the tuning
