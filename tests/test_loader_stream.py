"""weightcache.loader on a streaming view (docs/streaming-pods.md): a directory that grows while the node fetches.

A thread plays the daemon with real files: it hard-links a real safetensors model's files from a staging directory
into the view (os.link, as the daemon's linkat: a file appears whole) and replaces `.weightcache/state` by tmp +
rename, while the loader under test waits, polls and yields. Every load is compared with safetensors' own reading
of the staged files.
"""

from __future__ import annotations

import json
import os
import re
import sys
import threading
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.sample import make_model
from weightcache.errors import (
    FetchPendingError,
    ModelFileNotFoundError,
    ModelLayoutError,
    StreamFailedError,
    WeightcacheError,
)
from weightcache.loader import (
    INDEX_NAME,
    MAX_STATE_BYTES,
    iter_tensors,
    iter_tensors_streaming,
    planned_files,
    wait_for_files,
)
from weightcache.vocabulary import STREAM_COMPLETE, STREAM_DIR, STREAM_FAILED, STREAM_FETCHING, STREAM_STATE

ROOT = Path(__file__).resolve().parents[1]
SHARDS = [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
SMALL = ["config.json", "tokenizer_config.json", "tokenizer.json"]


def as_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for name, ref in want.items():
        assert (got[name].dtype, got[name].shape) == (ref.dtype, ref.shape), name
        assert as_bytes(got[name]) == as_bytes(ref), name


@pytest.fixture(scope="module")
def staged(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 3-shard model with its index, config and tokenizer: the blobs the daemon links from."""
    directory = tmp_path_factory.mktemp("staged")
    make_model(directory, layers=2, hidden=64, vocab=128, shards=3)
    assert sorted(p.name for p in directory.glob("*.safetensors")) == SHARDS
    return directory


def reference(directory: Path, shards: list[str] = SHARDS) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for s in shards:
        out.update(load_file(directory / s))
    return out


class Daemon:
    """The daemon's side of one view: links files in whole and replaces the state file."""

    def __init__(self, staged: Path, view: Path) -> None:
        self.staged, self.view = staged, view
        (view / STREAM_DIR).mkdir(parents=True)
        self.errors: list[BaseException] = []
        self._thread: threading.Thread | None = None
        self._pauses = 0
        self._paused = threading.Condition()

    def pause(self, seconds: float) -> None:
        """The loader's wait between two looks at the view (its `pause`), counted for `looked`."""
        with self._paused:
            self._pauses += 1
            self._paused.notify_all()
        time.sleep(seconds)

    def looked(self) -> None:
        """Return once the loader has looked at the view since this call, and found it wanting: the second pause
        from now follows a look that began after it (a held gate, not a sleep that hopes the loader looked)."""
        with self._paused:
            mark = self._pauses
            assert self._paused.wait_for(lambda: self._pauses >= mark + 2, timeout=5), "the loader stopped looking"

    def state(self, state: str = STREAM_FETCHING, files: list[str] | None = None, error: str | None = None,
              raw: bytes | None = None) -> None:
        tmp = self.view / STREAM_DIR / ".state.tmp"
        tmp.write_bytes(raw if raw is not None else json.dumps({"state": state, "files": files, "error": error})
                        .encode())
        os.rename(tmp, self.view / STREAM_STATE)

    def link(self, *rels: str) -> None:
        for rel in rels:
            os.link(self.staged / rel, self.view / rel)

    def run(self, script: Callable[[], None]) -> None:
        """`script` on a thread (what it raises is re-raised by join)."""
        def body() -> None:
            try:
                script()
            except BaseException as exc:
                self.errors.append(exc)
        self._thread = threading.Thread(target=body, daemon=True)
        self._thread.start()

    def join(self) -> None:
        assert self._thread is not None
        self._thread.join(10)
        assert not self._thread.is_alive()
        if self.errors:
            raise self.errors[0]


@pytest.fixture
def daemon(staged: Path, tmp_path: Path) -> Daemon:
    return Daemon(staged, tmp_path / "view")


def plan(*, index: bool = True) -> list[str]:
    """What the daemon's state lists for the staged model (the index left out: a model of root shards only)."""
    return [*SMALL, *([INDEX_NAME] if index else []), *SHARDS]


def test_without_a_state_file_it_is_the_directory_load(staged: Path) -> None:
    got = dict(iter_tensors_streaming(staged))
    assert_same(got, reference(staged))
    assert list(got) == [n for n, _ in iter_tensors(staged)]  # the same order too
    some = dict(iter_tensors_streaming(staged, keys=lambda n: n.startswith("model.layers.1.")))
    assert set(some) == {n for n in got if n.startswith("model.layers.1.")} and some
    with pytest.raises(ModelLayoutError, match="requested tensors are not in the model"):
        dict(iter_tensors_streaming(staged, keys=["no.such.tensor"]))
    assert planned_files(staged) is None
    wait_for_files(staged, ["config.json"])  # a plain snapshot: there, nothing to wait for
    with pytest.raises(ModelFileNotFoundError, match=re.escape("no 'absent.json'")):
        wait_for_files(staged, ["absent.json"])


def test_shards_are_yielded_as_they_arrive_with_the_index(daemon: Daemon, staged: Path) -> None:
    first_tensor = threading.Event()

    def script() -> None:
        daemon.looked()  # the listing is not in hand yet
        daemon.state(files=plan())
        daemon.looked()
        daemon.link(*SMALL, SHARDS[0])  # a shard before the index: held until the index says it is the model's
        daemon.looked()
        daemon.link(INDEX_NAME)
        assert first_tensor.wait(5)
        daemon.link(SHARDS[1])
        daemon.looked()
        daemon.link(SHARDS[2])
        daemon.state(STREAM_COMPLETE, plan())

    daemon.state(files=None)
    daemon.run(script)
    got: dict[str, torch.Tensor] = {}
    for name, tensor in iter_tensors_streaming(daemon.view, timeout=5, pause=daemon.pause):
        if not got:
            # streaming for real: the first tensors come while the other shards are still missing
            assert not (daemon.view / SHARDS[1]).exists() and not (daemon.view / SHARDS[2]).exists()
            first_tensor.set()
        got[name] = tensor
    daemon.join()
    assert_same(got, reference(staged))
    assert all(t.data_ptr() != 0 for t in got.values() if t.numel())


def test_shards_out_of_order_without_an_index(daemon: Daemon, staged: Path) -> None:
    order = [SHARDS[2], SHARDS[0], SHARDS[1]]

    def script() -> None:
        for rel in order:
            daemon.looked()  # the shard before was seen (and handed out) first
            daemon.link(rel)

    daemon.state(files=plan(index=False))  # no index planned: every root *.safetensors
    daemon.run(script)
    names: list[str] = []
    got: dict[str, torch.Tensor] = {}
    for name, tensor in iter_tensors_streaming(daemon.view, timeout=5, pause=daemon.pause):
        names.append(name)
        got[name] = tensor
    daemon.join()
    assert_same(got, reference(staged))
    by_shard = [list(load_file(staged / rel)) for rel in order]
    assert names == [n for shard in by_shard for n in shard]  # in the order the shards arrived


def test_failed_state_raises_the_daemons_error(daemon: Daemon, staged: Path) -> None:
    def script() -> None:
        daemon.looked()
        daemon.link(INDEX_NAME, SHARDS[0])
        daemon.looked()  # the first shard was handed out: the loader waits for the second
        daemon.state(STREAM_FAILED, plan(), "model-00002-of-00003.safetensors: sha256 mismatch from the peer")

    daemon.state(files=plan())
    daemon.run(script)
    got = []
    with pytest.raises(StreamFailedError, match="sha256 mismatch from the peer"):
        for name, _ in iter_tensors_streaming(daemon.view, timeout=5, pause=daemon.pause):
            got.append(name)
    daemon.join()
    assert got == list(load_file(staged / SHARDS[0]))  # what was there was loaded; then the error, not a hang


def test_complete_without_a_planned_shard(daemon: Daemon, staged: Path) -> None:
    daemon.link(INDEX_NAME, SHARDS[0], SHARDS[2])
    daemon.state(STREAM_COMPLETE, plan())
    with pytest.raises(ModelFileNotFoundError, match=re.escape(f"complete but lacks '{SHARDS[1]}'")):
        dict(iter_tensors_streaming(daemon.view, timeout=5))


def test_index_naming_a_shard_the_view_will_not_hold(daemon: Daemon, staged: Path) -> None:
    daemon.link(INDEX_NAME, *SHARDS[:2])
    daemon.state(files=[INDEX_NAME, *SHARDS[:2]])  # the grant's globs left the third shard out
    with pytest.raises(ModelFileNotFoundError, match=re.escape(f"names shard '{SHARDS[2]}', which the streaming view")):
        dict(iter_tensors_streaming(daemon.view, timeout=5))


def test_no_progress_times_out_fast_naming_what_it_waits_for(daemon: Daemon, staged: Path) -> None:
    daemon.link(INDEX_NAME, SHARDS[0])
    daemon.state(files=plan())
    started = time.monotonic()
    got = []
    with pytest.raises(FetchPendingError) as caught:
        for name, _ in iter_tensors_streaming(daemon.view, timeout=0.5):
            got.append(name)
    assert 0.45 <= time.monotonic() - started < 3
    assert got == list(load_file(staged / SHARDS[0]))
    message = str(caught.value)
    assert str(daemon.view) in message and SHARDS[1] in message and "2 files" in message
    assert isinstance(caught.value, TimeoutError)

    view2 = daemon.view.parent / "view2"
    Daemon(staged, view2).state(files=None)
    with pytest.raises(FetchPendingError, match="the list of files"):
        planned_files(view2, timeout=0.3)


def test_the_clock_restarts_on_each_new_shard_and_the_consumers_time_does_not_count(
        daemon: Daemon, staged: Path) -> None:
    """Shards 0.3 s apart, 0.9 s in all, under a 0.5 s timeout; and a consumer that dawdles 0.8 s on its first
    tensor before the next shard takes 0.3 s more: neither is 0.5 s without progress."""
    resumed = threading.Event()

    def script() -> None:
        for rel in (INDEX_NAME, SHARDS[0]):
            time.sleep(0.3)
            daemon.link(rel)
        assert resumed.wait(5)
        time.sleep(0.3)
        daemon.link(SHARDS[1])
        time.sleep(0.3)
        daemon.link(SHARDS[2])

    daemon.state(files=plan())
    daemon.run(script)
    got: dict[str, torch.Tensor] = {}
    first = set(load_file(staged / SHARDS[0]))
    for name, tensor in iter_tensors_streaming(daemon.view, timeout=0.5):
        got[name] = tensor
        if set(got) == first:
            time.sleep(0.8)
            resumed.set()
    daemon.join()
    assert_same(got, reference(staged))


def test_a_symlink_for_the_state_is_refused(daemon: Daemon, staged: Path, tmp_path: Path) -> None:
    elsewhere = tmp_path / "planted.json"
    elsewhere.write_text(json.dumps({"state": STREAM_COMPLETE, "files": SHARDS, "error": None}))
    daemon.link(*SHARDS)
    (daemon.view / STREAM_STATE).symlink_to(elsewhere)
    with pytest.raises(ModelLayoutError, match=r"refusing .*state.*symlink"):
        dict(iter_tensors_streaming(daemon.view, timeout=1))
    # and a symlinked .weightcache directory
    (daemon.view / STREAM_STATE).unlink()
    (daemon.view / STREAM_DIR).rmdir()
    real = tmp_path / "real"
    real.mkdir()
    (real / "state").write_text(elsewhere.read_text())
    (daemon.view / STREAM_DIR).symlink_to(real)
    with pytest.raises(ModelLayoutError, match="refusing"):
        dict(iter_tensors_streaming(daemon.view, timeout=1))


def test_a_fifo_for_the_state_is_refused_without_hanging(daemon: Daemon) -> None:
    os.mkfifo(daemon.view / STREAM_STATE)
    with pytest.raises(ModelLayoutError, match="not a regular file"):
        dict(iter_tensors_streaming(daemon.view, timeout=1))


HOSTILE: dict[str, tuple[bytes, str]] = {
    "huge": (b'{"state": "fetching", "files": ["' + b"a" * MAX_STATE_BYTES + b'"]}', "larger than 16 MiB"),
    "bad json": (b'{"state": "fetching", "files": [', "not JSON"),
    "not utf-8": (b'{"state": "\xff"}', "not JSON"),
    "deep": (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    "not an object": (b'["fetching"]', "not a JSON object"),
    "unknown state": (b'{"state": "done", "files": []}', "state 'done' is none of"),
    "files not a list": (b'{"state": "fetching", "files": "model.safetensors"}', "files must be a list"),
    "files not strings": (b'{"state": "fetching", "files": [1]}', "files must be a list"),
    "dotdot": (b'{"state": "fetching", "files": ["../../etc/passwd"]}', "not a relative path inside the view"),
    "dotdot inside": (b'{"state": "fetching", "files": ["a/../../b.safetensors"]}', "not a relative path"),
    "absolute": (b'{"state": "fetching", "files": ["/etc/shadow"]}', "not a relative path"),
    "empty name": (b'{"state": "fetching", "files": [""]}', "not a relative path"),
    "nul": (b'{"state": "fetching", "files": ["a\\u0000.safetensors"]}', "not a relative path"),
    "error not a string": (b'{"state": "failed", "files": null, "error": {"x": 1}}', "error must be a string"),
    "complete without files": (b'{"state": "complete", "files": null, "error": null}', "must list its files"),
}


@pytest.mark.parametrize("case", HOSTILE, ids=list(HOSTILE))
def test_a_hostile_state_is_a_clear_error(daemon: Daemon, case: str) -> None:
    raw, why = HOSTILE[case]
    daemon.state(raw=raw)
    with pytest.raises(ModelLayoutError, match="is not a state the weightcache daemon writes") as caught:
        dict(iter_tensors_streaming(daemon.view, timeout=1))
    assert why in str(caught.value) and len(str(caught.value)) < 1000
    with pytest.raises(ModelLayoutError, match=re.escape(why)):
        wait_for_files(daemon.view, timeout=1)


def test_a_hostile_state_written_mid_stream_is_caught(daemon: Daemon, staged: Path) -> None:
    def script() -> None:
        daemon.looked()  # mid-stream: the first shard was handed out
        daemon.state(raw=b'{"state": "fetching", "files": ["../x"]}')

    daemon.link(INDEX_NAME, SHARDS[0])
    daemon.state(files=plan())
    daemon.run(script)
    with pytest.raises(ModelLayoutError, match="not a relative path inside the view"):
        dict(iter_tensors_streaming(daemon.view, timeout=5, pause=daemon.pause))
    daemon.join()


def test_a_huge_failed_error_is_shortened(daemon: Daemon) -> None:
    daemon.state(STREAM_FAILED, None, "x" * 100_000)
    with pytest.raises(StreamFailedError) as caught:
        dict(iter_tensors_streaming(daemon.view, timeout=1))
    assert 4000 <= len(str(caught.value)) < 5000


def test_a_tensor_in_two_shards(daemon: Daemon, tmp_path: Path) -> None:
    staging = daemon.staged = tmp_path / "dup"
    staging.mkdir()
    save_file({"a": torch.ones(3), "shared": torch.zeros(2)}, str(staging / "a.safetensors"))
    save_file({"b": torch.ones(4), "shared": torch.ones(2)}, str(staging / "b.safetensors"))
    daemon.state(files=["a.safetensors", "b.safetensors"])
    daemon.link("a.safetensors")
    daemon.run(lambda: (daemon.looked(), daemon.link("b.safetensors")))  # after a.safetensors was handed out
    with pytest.raises(ModelLayoutError, match="'shared' appears in more than one file"):
        dict(iter_tensors_streaming(daemon.view, timeout=5, pause=daemon.pause))
    daemon.join()


def test_an_index_mapping_a_tensor_to_a_shard_without_it(daemon: Daemon, staged: Path, tmp_path: Path) -> None:
    staging = daemon.staged = tmp_path / "lying-index"
    staging.mkdir()
    for rel in SHARDS:
        os.link(staged / rel, staging / rel)
    index = json.loads((staged / INDEX_NAME).read_text())
    index["weight_map"]["model.ghost.weight"] = SHARDS[1]
    (staging / INDEX_NAME).write_text(json.dumps(index))
    daemon.link(INDEX_NAME, *SHARDS)
    daemon.state(STREAM_COMPLETE, [INDEX_NAME, *SHARDS])
    with pytest.raises(ModelLayoutError, match=re.escape(f"maps 1 tensors to {SHARDS[1]}")):
        dict(iter_tensors_streaming(daemon.view, timeout=5))


def test_a_view_planning_no_safetensors(daemon: Daemon) -> None:
    daemon.state(files=["config.json", "pytorch_model.bin", "sub/model.safetensors"])
    with pytest.raises(ModelLayoutError, match=re.escape("will hold no *.safetensors file")):
        dict(iter_tensors_streaming(daemon.view, timeout=1))


def test_wait_for_files(daemon: Daemon, staged: Path) -> None:
    def script() -> None:
        daemon.looked()
        daemon.state(files=plan())
        for rel in [SHARDS[0], *SMALL, INDEX_NAME]:
            daemon.looked()
            daemon.link(rel)

    daemon.state(files=None)
    daemon.run(script)
    wait_for_files(daemon.view, timeout=5, pause=daemon.pause)  # every planned file but the shards
    assert all((daemon.view / rel).is_file() for rel in [*SMALL, INDEX_NAME])
    assert not (daemon.view / SHARDS[1]).exists()
    daemon.join()
    wait_for_files(daemon.view, ["config.json", "./tokenizer.json"], timeout=5)
    assert planned_files(daemon.view) == plan()
    with pytest.raises(ModelFileNotFoundError, match=re.escape("will not hold 'chat_template.jinja'")):
        wait_for_files(daemon.view, ["chat_template.jinja"], timeout=5)
    with pytest.raises(ValueError, match="not a relative path"):
        wait_for_files(daemon.view, ["../config.json"], timeout=5)
    with pytest.raises(FetchPendingError, match=re.escape(SHARDS[1])):
        wait_for_files(daemon.view, [SHARDS[1]], timeout=0.2)
    daemon.state(STREAM_FAILED, plan(), "NoSuchBucket: models")
    with pytest.raises(StreamFailedError, match="NoSuchBucket"):
        wait_for_files(daemon.view, ["config.json"], timeout=5)


def test_the_state_disappearing_is_an_error_not_a_hang(daemon: Daemon, staged: Path) -> None:
    daemon.link(INDEX_NAME)
    daemon.state(files=plan())
    daemon.run(lambda: (daemon.looked(), (daemon.view / STREAM_STATE).unlink()))  # while the loader waits
    with pytest.raises(ModelFileNotFoundError, match="disappeared"):
        dict(iter_tensors_streaming(daemon.view, timeout=5, pause=daemon.pause))
    daemon.join()


# ---- the vLLM plugin's choice, without vLLM --------------------------------------------------------------------


@pytest.fixture
def plugin(monkeypatch: pytest.MonkeyPatch) -> Iterator[types.ModuleType]:
    """weightcache_vllm.vllm_loader imported against stand-ins for the vLLM names it imports: the three at the top,
    and the config lookup after a load (vLLM's answers None outside a config context, as here)."""
    class BaseModelLoader:
        def __init__(self, load_config: Any) -> None:
            self.load_config = load_config

    class DefaultModelLoader(BaseModelLoader):
        def load_weights(self, model: Any, model_config: Any) -> None:
            raise AssertionError("the default loader was used")

    logger = types.ModuleType("vllm.logger")
    logger.init_logger = lambda name: __import__("logging").getLogger(name)  # type: ignore[attr-defined]
    loader = types.ModuleType("vllm.model_executor.model_loader")
    loader.BaseModelLoader = BaseModelLoader  # type: ignore[attr-defined]
    loader.DefaultModelLoader = DefaultModelLoader  # type: ignore[attr-defined]
    loader.register_model_loader = lambda name: lambda cls: cls  # type: ignore[attr-defined]
    config = types.ModuleType("vllm.config")
    config.get_current_vllm_config_or_none = lambda: None  # type: ignore[attr-defined]
    for name, module in {"vllm": types.ModuleType("vllm"), "vllm.logger": logger, "vllm.config": config,
                         "vllm.model_executor": types.ModuleType("vllm.model_executor"),
                         "vllm.model_executor.model_loader": loader}.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.syspath_prepend(str(ROOT / "packages" / "weightcache-vllm"))
    for name in [m for m in sys.modules if m.startswith("weightcache_vllm")]:
        monkeypatch.delitem(sys.modules, name)
    import weightcache_vllm.vllm_loader as module

    yield module
    for name in [m for m in sys.modules if m.startswith("weightcache_vllm")]:
        del sys.modules[name]


def _vllm_model_config(model: Path) -> types.SimpleNamespace:
    return types.SimpleNamespace(model=str(model), quantization=None,
                                 hf_text_config=types.SimpleNamespace(tie_word_embeddings=True, num_hidden_layers=2))


class _Model:
    def __init__(self) -> None:
        self.got: dict[str, torch.Tensor] = {}

    def load_weights(self, weights: Iterator[tuple[str, torch.Tensor]]) -> set[str]:
        self.got = dict(weights)
        return set(self.got)


def test_the_vllm_plugin_streams_from_a_view_before_its_shards_are_there(
        plugin: types.ModuleType, daemon: Daemon, staged: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    report = tmp_path / "report.jsonl"
    monkeypatch.setenv(plugin.REPORT_ENV, str(report))
    monkeypatch.delenv(plugin.MODEL_PATH_ENV, raising=False)
    daemon.link(*SMALL)
    daemon.state(files=plan())
    # no shard and no index in the view yet: still a safetensors model, by the plan
    assert plugin.snapshot_dir(str(daemon.view), plugin.Options()) == daemon.view
    loader = plugin.WeightcacheModelLoader(types.SimpleNamespace(
        model_loader_extra_config={"exclude": ["model.layers.1.*"], "verify": False, "stream_timeout": 5}))

    def script() -> None:
        for rel in (SHARDS[1], INDEX_NAME, SHARDS[0], SHARDS[2]):
            time.sleep(0.1)
            daemon.link(rel)
        daemon.state(STREAM_COMPLETE, plan())

    daemon.run(script)
    model = _Model()
    loader.load_weights(model, _vllm_model_config(daemon.view))
    daemon.join()
    want = {n: t for n, t in reference(staged).items()
            if not n.startswith("model.layers.1.") and n != "lm_head.weight"}  # exclude glob, tied embeddings
    assert_same(model.got, want)
    (record,) = [json.loads(line) for line in report.read_text().splitlines()]
    assert record["streaming"] is True and record["fallback"] is False and record["tensors"] == len(want)


def test_the_vllm_plugin_on_a_view_that_plans_no_safetensors_or_failed(
        plugin: types.ModuleType, daemon: Daemon, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(plugin.MODEL_PATH_ENV, raising=False)
    daemon.state(files=["config.json", "pytorch_model.bin"])
    assert plugin.snapshot_dir(str(daemon.view), plugin.Options()) is None  # the default loader's, once filled
    daemon.state(STREAM_FAILED, None, "AccessDenied: s3://models/m/")
    with pytest.raises(StreamFailedError, match="AccessDenied"):
        plugin.snapshot_dir(str(daemon.view), plugin.Options())
    daemon.state(files=None)
    with pytest.raises(FetchPendingError):  # a stalled view is an error, never a fallback to a half-filled one
        plugin.snapshot_dir(str(daemon.view), plugin.Options(stream_timeout=0.2))
    assert issubclass(FetchPendingError, WeightcacheError)


@pytest.mark.parametrize("extra", [{"stream_timeout": 0}, {"stream_timeout": "5"}, {"stream_timeout": True},
                                   {"stream_timeout": float("nan")}])
def test_the_vllm_plugin_refuses_a_bad_stream_timeout(plugin: types.ModuleType, extra: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="stream_timeout"):
        plugin.parse_options(extra)
