"""A big header is checked in child processes, cut into parts (weightcache/safetensors_split.py): on every header,
cut anywhere, the verdict and the words are the in-process check's; the parts road decides the usual headers and
the first tensor wrong on its own; a repeated key across parts, a broken layout or anything unusual goes to one
child running the whole check; a worker that dies is an error, never a verdict."""

from __future__ import annotations

import json
import os
import random
import signal
import struct
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings

from tests.grants import granted
from tests.test_safetensors_check_fast import blob_of, headers, t8
from weightcache import safetensors_check, safetensors_split
from weightcache.errors import SafetensorsHeaderError, StoreError
from weightcache.fetch import Fetcher
from weightcache.store import Store

PARTS = 3


@pytest.fixture
def every_header_in_parts(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Headers of any size go to the children, in PARTS parts whatever the cores here."""
    monkeypatch.setattr(safetensors_check, "CHILD_MIN_BYTES", 2)
    monkeypatch.setattr(safetensors_split, "_part_count", lambda header_len: PARTS)
    yield


def verdicts(path: Path) -> tuple[Any, Any]:
    """(in child processes, in this process): ("ok",) or ("refused", message)."""
    out: list[tuple[str, ...]] = []
    for check in (safetensors_check.check_file, _in_process):
        try:
            check(path)
            out.append(("ok",))
        except SafetensorsHeaderError as exc:
            out.append(("refused", str(exc)))
    return out[0], out[1]


def _in_process(path: Path) -> None:
    with open(path, "rb") as fh:
        safetensors_check.check_open(fh, str(path))


def write(tmp_path: Path, text: str, data_len: int) -> Path:
    path = tmp_path / "model.safetensors"
    path.write_bytes(blob_of(text, max(data_len, 0)))
    return path


def tensors(count: int, *, start: int = 0, name: str = "t") -> list[str]:
    return [f'"{name}{i:06d}":{t8(start + i)}' for i in range(count)]


def header(*pairs: str) -> str:
    return "{" + ",".join(pairs) + "}"


no_whole = mock.patch.object(safetensors_split, "_run_whole", side_effect=AssertionError("the whole road was taken"))


@pytest.mark.usefixtures("every_header_in_parts")
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(headers())
def test_parts_and_one_process_agree_on_any_header(tmp_path: Path, case: tuple[str, int]) -> None:
    text, data_len = case
    parts, whole = verdicts(write(tmp_path, text, data_len))
    assert parts == whole


@pytest.mark.usefixtures("every_header_in_parts")
@pytest.mark.parametrize("separator", [",", ", ", ",\n  "])
def test_the_usual_header_is_decided_by_its_parts(tmp_path: Path, separator: str) -> None:
    text = "{" + separator.join(['"__metadata__":{"format":"pt"}', *tensors(3000)]) + "}"
    path = write(tmp_path, text, 3000)
    with no_whole:
        safetensors_check.check_file(path)


@pytest.mark.usefixtures("every_header_in_parts")
def test_parts_out_of_file_order_are_sorted_before_the_layout_check(tmp_path: Path) -> None:
    late, early = tensors(1500, start=1500, name="a"), tensors(1500, name="b")
    path = write(tmp_path, header(*late, *early, '"__metadata__":{"format":"pt"}'), 3000)
    with no_whole:
        safetensors_check.check_file(path)


@pytest.mark.usefixtures("every_header_in_parts")
def test_the_first_wrong_tensor_in_a_later_part_is_refused_in_the_whole_checks_words(tmp_path: Path) -> None:
    pairs = tensors(3000)
    pairs[2500] = '"t002500":{"dtype":"I16","shape":[1],"data_offsets":[2500,2501]}'
    pairs[2900] = '"t002900":{"dtype":"I8","shape":[1],"data_offsets":[2900,2902]}'
    path = write(tmp_path, header(*pairs), 3000)
    parts, whole = verdicts(path)
    assert parts == whole and "'t002500'" in whole[1]
    with no_whole, pytest.raises(SafetensorsHeaderError, match="t002500"):
        safetensors_check.check_file(path)


@pytest.mark.usefixtures("every_header_in_parts")
@pytest.mark.parametrize("case", ["key in two parts", "metadata in two parts", "gap across parts",
                                  "overlap across parts", "empty tensor", "past the data", "data left over"])
def test_what_the_parts_cannot_pass_gets_the_whole_checks_verdict(tmp_path: Path, case: str) -> None:
    pairs, data = tensors(3000), 3000
    if case == "key in two parts":
        pairs[2900] = '"t000010":' + t8(2900)
    elif case == "metadata in two parts":
        pairs[5:5] = ['"__metadata__":{"a":"b"}']
        pairs[2950:2950] = ['"__metadata__":{"c":"d"}']
    elif case == "gap across parts":
        pairs = tensors(1500) + tensors(1500, start=1501, name="u")
        data = 3001
    elif case == "overlap across parts":
        pairs = tensors(1500) + tensors(1500, start=1499, name="u")
        data = 2999
    elif case == "empty tensor":
        pairs[2000:2000] = ['"empty":{"dtype":"F32","shape":[0],"data_offsets":[2000,2000]}']
    elif case == "past the data":
        data = 2999
    else:
        data = 3001
    parts, whole = verdicts(write(tmp_path, header(*pairs), data))
    assert parts == whole
    assert whole[0] == ("ok" if case == "empty tensor" else "refused")


@pytest.mark.usefixtures("every_header_in_parts")
@pytest.mark.parametrize("second", [500, 1499, 1500])
def test_keys_ascending_in_each_part_are_distinct_only_when_they_ascend_across(tmp_path: Path, second: int) -> None:
    """Two parts, each with its keys ascending: the second's first key below or at the first's last is a repeat
    (for 500 and 1499) that the key hashes must find; above it (1500), the keys are distinct without them."""
    pairs = tensors(1500) + [f'"t{second + i:06d}":{t8(1500 + i)}' for i in range(1500)]
    path = write(tmp_path, header(*pairs), 3000)
    text = path.read_bytes()[8:]
    cut = text.rindex(b'},"t%06d"' % second)  # the second part starts with tensor `second`
    with mock.patch.object(safetensors_split, "_cuts", return_value=[cut]), \
            mock.patch.object(safetensors_split, "_send", wraps=safetensors_split._send) as sent:
        parts, whole = verdicts(path)
    assert parts == whole == (("ok",) if second == 1500 else ("refused", whole[1]))
    asked = [c for c in sent.call_args_list if c.args[1] == b"buckets"]
    assert len(asked) == (0 if second == 1500 else 2)


@pytest.mark.usefixtures("every_header_in_parts")
@pytest.mark.parametrize("spoiler", [
    ('"__metadata__":{"x":"y},","z":"w"}', 3000),  # a value ending in '},': the cut's '}' and ',' in a string
    ('"name},":' + t8(3000), 3001),  # a key ending in '},'
])
def test_a_cut_inside_a_string_is_never_taken_for_a_tensor_boundary(tmp_path: Path, spoiler: tuple[str, int]) -> None:
    pair, data = spoiler
    pairs = tensors(3000)
    pairs.insert(1500, pair)
    path = write(tmp_path, header(*pairs), data)
    text = path.read_bytes()[8:]
    inside = [i for i in range(len(text)) if text.startswith(b'},"', i) and text[i - 1:i] != b"]"]
    assert inside, "the spoiler puts a '},\"' inside a string"
    with mock.patch.object(safetensors_split, "_cuts", return_value=inside[:1]):
        parts, whole = verdicts(path)
    assert parts == whole == ("ok",)


@pytest.mark.usefixtures("every_header_in_parts")
def test_a_worker_killed_is_an_error_that_says_so_never_a_verdict(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(tmp_path, header(*tensors(3000)), 3000)
    real = safetensors_split._spawn

    def doomed(args: list[str], fd: int, seed: int) -> subprocess.Popen[bytes]:
        proc = real(args, fd, seed)
        proc.send_signal(signal.SIGKILL)
        return proc

    monkeypatch.setattr(safetensors_split, "_spawn", doomed)
    with pytest.raises(StoreError, match=r"model\.safetensors.*killed by signal 9.*more memory"):
        safetensors_check.check_file(path)


@pytest.mark.usefixtures("every_header_in_parts")
def test_no_process_to_be_had_checks_here_with_the_same_words(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pairs = tensors(3000)
    pairs[2999] = '"t002999":{"dtype":"F32","shape":[1],"data_offsets":[2999,3000]}'
    path = write(tmp_path, header(*pairs), 3000)
    _, whole = verdicts(path)
    monkeypatch.setattr(safetensors_split, "_spawn", mock.Mock(side_effect=BlockingIOError(11, "EAGAIN")))
    with pytest.raises(SafetensorsHeaderError) as refused:
        safetensors_check.check_file(path)
    assert ("refused", str(refused.value)) == whole


def test_a_fetch_refuses_a_big_hostile_header_from_the_workers_with_exit_7(tmp_path: Path) -> None:
    """No patching: a header over CHILD_MIN_BYTES, as the fetch engine meets it."""
    count = safetensors_check.CHILD_MIN_BYTES // 40 + 1000
    pairs = tensors(count)
    pairs[-1] = pairs[-1].replace('"I8"', '"I16"')
    text = header(*pairs)
    assert len(text) > safetensors_check.CHILD_MIN_BYTES
    src = tmp_path / "src"
    src.mkdir()
    (src / "model.safetensors").write_bytes(blob_of(text, count))
    (src / "config.json").write_text(json.dumps({"a": 1}))
    fetcher = Fetcher(Store(tmp_path / "root"))
    with pytest.raises(SafetensorsHeaderError, match=rf"model\.safetensors.*'t{count - 1:06d}'") as refused:
        fetcher.ensure(granted(f"file://{src}"))
    assert refused.value.answer.exit_code == 7
    assert fetcher.store.list() == []
    assert not list(fetcher.store.layout.partial.glob("*.part"))


def test_a_big_valid_header_passes_as_the_fetch_meets_it(tmp_path: Path) -> None:
    count = safetensors_check.CHILD_MIN_BYTES // 40 + 1000
    path = write(tmp_path, header('"__metadata__":{"format":"pt"}', *tensors(count)), count)
    safetensors_check.check_file(path)
    assert struct.unpack("<Q", path.read_bytes()[:8])[0] > safetensors_check.CHILD_MIN_BYTES


@pytest.mark.usefixtures("every_header_in_parts")
def test_the_workers_that_parse_hostile_bytes_get_no_credentials(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "hunter2-secret")
    path = write(tmp_path, header(*tensors(3000)), 3000)
    environments: list[dict[str, str]] = []
    real = subprocess.Popen

    def spy(*args: Any, **kwargs: Any) -> subprocess.Popen[bytes]:
        environments.append(kwargs["env"])
        return real(*args, **kwargs)

    monkeypatch.setattr(subprocess, "Popen", spy)
    safetensors_check.check_file(path)
    assert len(environments) == PARTS
    assert all("hunter2-secret" not in env.values() and "PYTHONHASHSEED" in env for env in environments)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(headers())
def test_the_whole_worker_told_of_a_repeat_reads_with_json_alone_and_says_the_same(tmp_path: Path,
                                                                                  case: tuple[str, int]) -> None:
    """A repeat found across parts sends the whole worker straight to json (the reference, which names it): on any
    header, repeat or not (a hash collision), its verdict is the full check's."""
    path = write(tmp_path, *case)
    said = []
    for repeated in (False, True):
        with open(path, "rb") as fh:
            try:
                safetensors_check.check_open(fh, str(path), repeated=repeated)
                said.append("ok")
            except SafetensorsHeaderError as exc:
                said.append(str(exc))
    assert said[0] == said[1]


@pytest.mark.usefixtures("every_header_in_parts")
@pytest.mark.parametrize("where", ["key", "metadata"])
def test_a_repeat_across_parts_is_named_as_json_names_it(tmp_path: Path, where: str) -> None:
    """The first key that repeats an earlier one, in header order (json's words); the workers find it from the
    keys behind repeated hashes, without the whole worker; a repeated "__metadata__" goes to it, straight to json."""
    pairs = tensors(3000)
    if where == "key":
        pairs[2900] = '"t000010":' + t8(2900)
        pairs[2950] = '"t000005":' + t8(2950)  # repeats an earlier key, but later in the header than t000010 does
    else:
        pairs[5:5] = ['"__metadata__":{"a":"b"}']
        pairs[2950:2950] = ['"__metadata__":{"c":"d"}']
    path = write(tmp_path, header(*pairs), 3000)
    with mock.patch.object(safetensors_split, "_spawn", wraps=safetensors_split._spawn) as spawned:
        parts, whole = verdicts(path)
    assert parts == whole and f"duplicate key '{'t000010' if where == 'key' else '__metadata__'}'" in whole[1]
    modes = [c.args[0][0] for c in spawned.call_args_list]
    assert modes == ["part"] * PARTS + ([] if where == "key" else ["whole"])
    if where == "metadata":
        assert spawned.call_args_list[-1].args[0][-1] == "repeated"


@pytest.mark.usefixtures("every_header_in_parts")
@pytest.mark.parametrize("collide", [False, True])
def test_keys_in_no_order_are_told_apart_by_their_hashes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          collide: bool) -> None:
    """Keys in descending order (their order proves nothing): the hash buckets show them distinct, and the parts
    decide. With a hash said to repeat (a collision: none can be aimed at a seed drawn per check, so the workers'
    answer is doctored), the keys behind it show that no key repeats."""
    count = 3000
    pairs = [f'"t{count - 1 - i:06d}":{t8(i)}' for i in range(count)]
    path = write(tmp_path, header(*pairs), count)
    monkeypatch.setattr(random, "SystemRandom", lambda: mock.Mock(randint=lambda a, b: 12345))
    seeded = subprocess.run([sys.executable, "-c", "print(hash('t000100'))"], env={"PYTHONHASHSEED": "12345"},
                            capture_output=True, text=True, check=True)
    real = safetensors_split._receive
    answers: list[subprocess.Popen[bytes]] = []
    doctored = []

    def receive(proc: subprocess.Popen[bytes], name: str) -> bytes:
        message = real(proc, name)
        answers.append(proc)
        if collide and answers.count(proc) == 3:  # its third answer, a bucket's repeats: none, said to be one
            assert msgspec.msgpack.decode(message) == []
            doctored.append(proc)
            return msgspec.msgpack.encode([int(seeded.stdout)])
        return message

    monkeypatch.setattr(safetensors_split, "_receive", receive)
    with no_whole:
        parts, whole = verdicts(path)
    assert parts == whole == ("ok",)
    assert len(doctored) == (PARTS if collide else 0)


@pytest.mark.parametrize(("cpu_max", "cores"), [("max 100000\n", None), ("50000 100000\n", 1),
                                                ("150000 100000\n", 2), ("garbage", None)])
def test_a_cgroup_cpu_quota_caps_the_workers(tmp_path: Path, cpu_max: str, cores: int | None) -> None:
    path = tmp_path / "cpu.max"
    path.write_text(cpu_max)
    affinity = len(os.sched_getaffinity(0))
    assert safetensors_split._cores(path) == min(affinity, cores or affinity)
    assert safetensors_split._cores(tmp_path / "absent") == affinity


@pytest.mark.usefixtures("every_header_in_parts")
def test_workers_started_before_one_fails_to_start_are_reaped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(tmp_path, header(*tensors(3000)), 3000)
    real = safetensors_split._spawn
    started: list[subprocess.Popen[bytes]] = []

    def second_fails(args: list[str], fd: int, seed: int) -> subprocess.Popen[bytes]:
        if len(started) == 1 and args[0] == "part":
            raise BlockingIOError(11, "EAGAIN")
        started.append(real(args, fd, seed))
        return started[-1]

    monkeypatch.setattr(safetensors_split, "_spawn", second_fails)
    safetensors_check.check_file(path)
    assert [proc for proc in started if proc.returncode is None] == []  # each waited for, none left running
    assert len(started) == 2  # the first part's worker, then the whole one


@pytest.mark.usefixtures("every_header_in_parts")
def test_a_worker_gone_between_questions_is_an_error_that_says_so(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    count = 3000
    path = write(tmp_path, header(*[f'"t{count - 1 - i:06d}":{t8(i)}' for i in range(count)]), count)  # no order
    real = safetensors_split._receive

    def receive(proc: subprocess.Popen[bytes], name: str) -> bytes:
        message = real(proc, name)
        proc.kill()  # after its first answer, before the parent asks for its key hashes
        proc.wait()
        return message

    monkeypatch.setattr(safetensors_split, "_receive", receive)
    with pytest.raises(StoreError, match="killed by signal 9"):
        safetensors_check.check_file(path)


@pytest.mark.usefixtures("every_header_in_parts")
def test_a_weightcache_package_in_the_working_directory_is_not_what_the_workers_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    planted = tmp_path / "cwd" / "weightcache"
    planted.mkdir(parents=True)
    marker = tmp_path / "ran"
    (planted / "__init__.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    (planted / "safetensors_split.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    path = write(tmp_path, header(*tensors(3000)), 3000)
    monkeypatch.chdir(planted.parent)
    safetensors_check.check_file(path)
    assert not marker.exists()


@pytest.mark.usefixtures("every_header_in_parts")
def test_big_headers_are_checked_one_at_a_time_in_a_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    paths = []
    for i in range(3):
        (tmp_path / str(i)).mkdir()
        paths.append(write(tmp_path / str(i), header(*tensors(3000)), 3000))
    real, running, most = safetensors_split._run_parts, [0], [0]
    lock = threading.Lock()

    def counted(*args: Any) -> Any:
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        try:
            return real(*args)
        finally:
            with lock:
                running[0] -= 1

    monkeypatch.setattr(safetensors_split, "_run_parts", counted)
    threads = [threading.Thread(target=safetensors_check.check_file, args=(p,)) for p in paths]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert most[0] == 1
