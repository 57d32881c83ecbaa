"""A process's cache of parsed env files (``_engine._parsed``): a chronic played again, or a grid
built again, is not parsed again, and gives the same objects, so the same episode."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pandas
import pytest

from asyncrunner._engine import _parsed
from tests.conftest import make_env
from tests.helpers import alive, signalled


def _spy(monkeypatch: pytest.MonkeyPatch, module: Any, name: str) -> list[str]:
    """The files ``module.name`` really parses (the cache's misses), in order."""
    parsed: list[str] = []
    original = getattr(module, name)

    def parse(path: Any, *args: Any, **kwargs: Any) -> Any:
        parsed.append(str(path))
        return original(path, *args, **kwargs)

    monkeypatch.setattr(module, name, parse)
    return parsed


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[str]:
    """The files pandas really parses, with an empty cache (in memory, and on disk in
    ``tmp_path``: ``grids``, ``chronics``)."""
    _forget(monkeypatch)
    monkeypatch.setattr(_parsed, "cache_home", lambda: str(tmp_path))
    return _spy(monkeypatch, pandas, "read_csv")


def _forget(monkeypatch: pytest.MonkeyPatch) -> None:
    """An empty memory, as in another process: only the disk holds earlier parses."""
    monkeypatch.setattr(_parsed, "_parsed", type(_parsed._parsed)())
    monkeypatch.setattr(_parsed, "_size", 0)


def _reset(env: Any, chronic: int, seed: int) -> Any:
    with _parsed.parsing_once():
        return env.reset(seed=seed, options={"time serie id": chronic})


def test_a_chronic_reset_again_is_served_from_memory_with_the_same_episode(
    reads: list[str],
) -> None:
    env = make_env("rte_case14_opponent")
    try:
        first = _reset(env, 0, 1)
        first_steps = [env.step(env.action_space())[0].to_vect() for _ in range(3)]
        parsed = len(reads)
        assert parsed > 0
        _reset(env, 1, 2)  # another chronic: parsed
        assert len(reads) > parsed
        parsed = len(reads)
        again = _reset(env, 0, 1)  # the first again: not parsed
        assert len(reads) == parsed
        np.testing.assert_array_equal(again.to_vect(), first.to_vect())
        steps = [env.step(env.action_space())[0].to_vect() for _ in range(3)]
        for a, b in zip(steps, first_steps, strict=True):
            np.testing.assert_array_equal(a, b)
    finally:
        env.close()
    assert pandas.read_csv is not _parsed._read_csv  # restored after each reset


def test_served_frames_are_copies_and_a_changed_file_is_read_again(
    reads: list[str], tmp_path: Path
) -> None:
    data = tmp_path / "load_p.csv"
    data.write_text("a;b\n1.5;2\n3.25;4\n")
    with _parsed.parsing_once():
        first = pandas.read_csv(data, sep=";")
        first.iloc[0, 0] = 99.0  # the caller's frame is its own
        second = pandas.read_csv(data, sep=";")
        assert len(reads) == 1
        assert second.iloc[0, 0] == 1.5 and list(second.dtypes) == [np.float64, np.int64]
        second.iloc[0, 0] = -1.0
        assert pandas.read_csv(data, sep=";").iloc[0, 0] == 1.5
        pandas.read_csv(data, sep=",")  # other arguments: read
        assert len(reads) == 2
        shutil.copy(data, tmp_path / "copy.csv")
        data.write_text("a;b\n7;8\n")  # changed (size): read again
        assert pandas.read_csv(data, sep=";").iloc[0, 0] == 7
        assert len(reads) == 3
        # Changed to the same size, its modification time set back (a copy tool keeping
        # times): read again (its old parse was served, found by the caches hunt).
        stat = data.stat()
        data.write_text("a;b\n9;8\n")
        os.utime(data, ns=(stat.st_atime_ns, stat.st_mtime_ns))
        assert data.stat().st_mtime_ns == stat.st_mtime_ns and data.stat().st_size == stat.st_size
        assert pandas.read_csv(data, sep=";").iloc[0, 0] == 9
        assert len(reads) == 4
        with open(tmp_path / "copy.csv") as f:  # a buffer: always read
            pandas.read_csv(f, sep=";")
        assert len(reads) == 5
    assert pandas.read_csv is not _parsed._read_csv


def test_a_relative_path_names_the_file_of_each_calls_working_folder(
    reads: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Two files of one size and modification time, named by one relative path from two working
    # folders: each call parses its own (a path's real path is kept only for absolute ones).
    for name, value in (("a", 1), ("b", 2)):
        (tmp_path / name).mkdir()
        data = tmp_path / name / "load_p.csv"
        data.write_text(f"x\n{value}\n")
        os.utime(data, ns=(1_000_000_000, 1_000_000_000))
    with _parsed.parsing_once():
        for name, value in (("a", 1), ("b", 2), ("a", 1)):
            monkeypatch.chdir(tmp_path / name)
            assert pandas.read_csv("load_p.csv").iloc[0, 0] == value
    assert len(reads) == 2  # the third call: a's, from memory


class _UnhashablePath(os.PathLike[str]):
    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __fspath__(self) -> str:
        return self.path

    def __eq__(self, other: object) -> bool:  # and so no __hash__
        return isinstance(other, _UnhashablePath) and other.path == self.path


def test_a_path_object_that_cannot_be_hashed_is_read_and_kept(
    reads: list[str], tmp_path: Path
) -> None:
    data = tmp_path / "load_p.csv"
    data.write_text("x\n3\n")
    with _parsed.parsing_once():
        for _ in range(2):
            assert pandas.read_csv(_UnhashablePath(data)).iloc[0, 0] == 3
    assert len(reads) == 1


def _play_the_same(reference: Any, built: list[Any]) -> None:
    """Episodes on the pristine envs ``built`` (``_Cached``) play the steps of one on a copy of
    ``reference``, an env built outside the cache."""
    runs = []
    for env in [reference.copy(), *(c.episode_env() for c in built)]:
        env.reset(seed=4, options={"time serie id": 1})
        runs.append([env.step(env.action_space())[0].to_vect() for _ in range(5)])
        env.close()
    for run in runs[1:]:
        for a, b in zip(run, runs[0], strict=True):
            np.testing.assert_array_equal(a, b)


def test_a_grid_built_again_is_not_parsed_again_and_plays_the_same(
    reads: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import pandapower  # type: ignore[import-untyped]
    from grid2op.Agent import DoNothingAgent

    from asyncrunner._engine._envs import _Cached
    from asyncrunner._engine._recipe import Recipe

    grids = _spy(monkeypatch, pandapower, "from_json")
    spy = pandapower.from_json
    reference = make_env("l2rpn_case14_sandbox")  # built outside the cache
    recipe = Recipe(reference.get_params_for_runner(), "class", DoNothingAgent)
    grids.clear()
    built = [_Cached(recipe), _Cached(recipe)]
    try:
        assert len(grids) == 1  # the second build's grid came from memory
        _play_the_same(reference, built)
    finally:
        for cached in built:
            cached.close()
        reference.close()
    assert pandapower.from_json is spy  # restored after each build


def test_a_grid_parsed_by_an_earlier_process_is_loaded_from_disk(
    reads: list[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import pandapower
    from grid2op.Agent import DoNothingAgent

    from asyncrunner._engine._envs import _Cached
    from asyncrunner._engine._recipe import Recipe

    grids = _spy(monkeypatch, pandapower, "from_json")
    reference = make_env("l2rpn_case14_sandbox")  # built outside the cache
    recipe = Recipe(reference.get_params_for_runner(), "class", DoNothingAgent)
    grids.clear()
    first = _Cached(recipe)  # parsed, and written to disk
    assert len(grids) == 1
    (kept,) = (tmp_path / "grids").iterdir()
    _forget(monkeypatch)  # another process: nothing in memory, the grid on disk
    second = _Cached(recipe)
    assert len(grids) == 1  # loaded, not parsed
    kept.write_bytes(b"damaged")
    _forget(monkeypatch)
    third = _Cached(recipe)
    assert len(grids) == 2  # a damaged file: parsed again, and written again whole
    (key,) = (k for k in _parsed._parsed if k[0] == "pandapower.from_json")
    assert _parsed._from_disk(key) is not None
    try:
        _play_the_same(reference, [first, second, third])
    finally:
        for cached in (first, second, third):
            cached.close()
        reference.close()


def test_the_command_line_builds_its_env_through_the_cache(tmp_path: Path) -> None:
    """``asyncrunner run`` (and ``score``) built their env with a plain ``grid2op.make``: every
    command parsed the grid again (l2rpn_idf_2023: 1.2 s; its workers copy that env)."""
    command = [sys.executable, "-m", "asyncrunner", "run", "-n", "1", "-w", "1", "--max-iter", "3"]
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
    tables = []
    for _ in range(2):
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        tables.append(done.stdout.splitlines()[:2])
        assert len(list((tmp_path / "asyncrunner" / "grids").iterdir())) == 1
    assert tables[0] == tables[1]  # the grid loaded from disk plays the same episode


def _chronic_files(tmp_path: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in (tmp_path / "chronics").glob("*.pickle")}


def test_a_chronic_parsed_by_an_earlier_process_is_loaded_from_disk_and_plays_the_same(
    reads: list[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    env = make_env("rte_case14_opponent")
    reference = env.copy()  # outside the cache
    reference.reset(seed=3, options={"time serie id": 1})
    expected = [reference.step(reference.action_space())[0].to_vect() for _ in range(4)]
    reference.close()

    def play() -> None:
        _forget(monkeypatch)  # another process: nothing in memory
        episode = env.copy()
        _reset(episode, 1, 3)
        steps = [episode.step(episode.action_space())[0].to_vect() for _ in range(4)]
        episode.close()
        for a, b in zip(steps, expected, strict=True):
            np.testing.assert_array_equal(a, b)

    try:
        reads.clear()
        play()  # parsed, and written to disk
        parsed = len(reads)
        assert parsed > 0 and len(_chronic_files(tmp_path)) == parsed  # one file each
        play()
        assert len(reads) == parsed  # loaded, not parsed
        for kept in (tmp_path / "chronics").glob("*.pickle"):
            kept.write_bytes(b"damaged")
        play()
        assert len(reads) == 2 * parsed  # damaged files: parsed again, and written again whole
        play()
        assert len(reads) == 2 * parsed
    finally:
        env.close()


def test_the_chronics_kept_on_disk_stay_within_their_bound(
    reads: list[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    env = make_env("rte_case14_opponent")
    try:
        _reset(env, 0, 1)
        one = sum(_chronic_files(tmp_path).values())  # a chronic's files
        first = set(_chronic_files(tmp_path))
        monkeypatch.setattr(_parsed, "DISK_BYTES", one + one // 2)
        time.sleep(0.01)  # the next files are newer (modification times order them)
        _reset(env, 1, 1)
        kept = _chronic_files(tmp_path)
        assert sum(kept.values()) <= one + one // 2
        # chronic 1's files all kept (the newest), some of chronic 0's gone (the oldest)
        assert len(set(kept) - first) == len(first) and not first <= set(kept)
        _forget(monkeypatch)
        before = len(reads)
        _reset(env, 1, 1)
        assert len(reads) == before  # loaded from disk
        monkeypatch.setattr(_parsed, "DISK_BYTES", 0)  # keep none, read none
        _forget(monkeypatch)
        _reset(env, 1, 1)
        assert len(reads) > before  # parsed: what is on disk is not read (it was)
        shutil.rmtree(tmp_path / "chronics")
        _forget(monkeypatch)
        _reset(env, 2, 1)
        assert not (tmp_path / "chronics").exists()  # nothing more is written
    finally:
        env.close()


def _finished(ahead: _parsed.ParsedAhead, resets: int, seconds: float = 60) -> None:
    """Waits (a probe with a deadline) until the helper saved the parses of ``resets`` resets."""
    folder = Path(ahead._folder)
    deadline = time.monotonic() + seconds
    while len(list(folder.glob("*.pickle"))) < resets:
        assert time.monotonic() < deadline, "the helper did not finish"
        time.sleep(0.05)


def _reaped(pid: int) -> bool:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return True
    return False


def test_chronics_parsed_ahead_by_a_helper_are_not_parsed_here(reads: list[str]) -> None:
    env = make_env("rte_case14_opponent")
    options = {"time serie id": 1, "max step": 20}
    expected = env.copy()
    try:
        obs = expected.reset(seed=3, options=options)  # outside the cache: parsed here
        reads.clear()
        ahead = _parsed.ParsedAhead(env, [options])
        pid = ahead._pid
        _finished(ahead, 1)
        ahead.join()
        assert reads == []  # the helper parsed them, in its own process
        assert _reaped(pid) and not Path(ahead._folder).exists()
        episode = env.copy()
        with _parsed.parsing_once():
            again = episode.reset(seed=3, options=options)
        assert reads == []  # every file from the helper's parses
        np.testing.assert_array_equal(again.to_vect(), obs.to_vect())
        for _ in range(5):
            np.testing.assert_array_equal(
                episode.step(env.action_space())[0].to_vect(),
                expected.step(env.action_space())[0].to_vect(),
            )
        with _parsed.parsing_once():
            episode.reset(seed=3, options={"time serie id": 0, "max step": 20})
        assert reads  # a chronic the helper did not parse is parsed here
        episode.close()
    finally:
        expected.close()
        env.close()


def test_a_helper_stopped_early_or_failing_leaves_nothing_behind(reads: list[str]) -> None:
    env = make_env("rte_case14_opponent")
    try:
        failing = _parsed.ParsedAhead(env, [{"time serie id": "no_such_chronic"}])
        pid = failing._pid
        os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)  # it ends on its own (not reaped)
        failing.join()
        assert len(_parsed._parsed) == 0 and not Path(failing._folder).exists()
        stopped = _parsed.ParsedAhead(env, [{"time serie id": i} for i in range(50)])
        pid = stopped._pid
        stopped.join()  # at once: keeps what it finished, if anything
        stopped.join()  # idempotent
        assert _reaped(pid) and not Path(stopped._folder).exists()
    finally:
        env.close()


def test_a_helper_reaped_by_the_kernel_is_joined_and_not_signalled(
    reads: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # In a program that ignores SIGCHLD (its children reaped by the kernel), join raised
    # ChildProcessError (a score failed), and a helper that had ended on its own had its pid,
    # freed at its end, sent SIGKILL.
    env = make_env("rte_case14_opponent")
    previous = signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    try:
        ahead = _parsed.ParsedAhead(env, [{"time serie id": 1, "max step": 20}])
        pid = ahead._pid
        _finished(ahead, 1)
        deadline = time.monotonic() + 60
        while alive(pid):
            assert time.monotonic() < deadline, "the helper did not end"
            time.sleep(0.01)
        killed = signalled(monkeypatch)
        ahead.join()
        assert pid not in killed and not Path(ahead._folder).exists()
        assert len(_parsed._parsed) > 0  # what it parsed is kept
        running = _parsed.ParsedAhead(env, [{"time serie id": i} for i in range(50)])
        pid = running._pid
        running.join()  # still parsing: killed, then joined
        assert pid in killed and not alive(pid)
    finally:
        signal.signal(signal.SIGCHLD, previous)
        env.close()


def test_a_helper_is_joined_in_a_process_with_a_thousand_files_open(reads: list[str]) -> None:
    # A web app's sockets: its descriptors' numbers above 1023, where select() refuses them.
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 2048)), hard))
    env = make_env("rte_case14_opponent")
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        ahead = _parsed.ParsedAhead(env, [{"time serie id": 1, "max step": 20}])
        assert ahead._ended > 1023
        ahead.join()
        assert not Path(ahead._folder).exists()
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        env.close()


def test_a_helper_forked_from_a_thread_does_not_warn(reads: list[str]) -> None:
    # As sharing_workers starts it: in a thread. Python >= 3.12 then warns that a
    # multi-threaded process forks (shown by pytest's and Jupyter's default filters); the
    # warning is recorded here, not raised (CPython clears a warning raised at fork).
    env = make_env("rte_case14_opponent")
    helpers: list[_parsed.ParsedAhead] = []
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            thread = threading.Thread(
                target=lambda: helpers.append(_parsed.ParsedAhead(env, [{"time serie id": 0}]))
            )
            thread.start()
            thread.join()
        assert len(helpers) == 1
        assert [str(w.message) for w in caught if "multi-threaded" in str(w.message)] == []
    finally:
        for helper in helpers:
            helper.join()
        env.close()


def test_the_grids_and_the_scores_share_the_cache_folder_the_readme_names(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from asyncrunner._score._grid2op import default_cache_dir

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert _parsed._disk_folder("pandapower.from_json") == str(tmp_path / "asyncrunner" / "grids")
    assert _parsed._disk_folder("pandas.read_csv") == str(tmp_path / "asyncrunner" / "chronics")
    assert default_cache_dir() == str(tmp_path / "asyncrunner" / "scores")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    home = tmp_path / "home" / ".cache" / "asyncrunner"
    assert _parsed._disk_folder("pandapower.from_json") == str(home / "grids")
    assert default_cache_dir() == str(tmp_path / "home" / ".cache" / "asyncrunner" / "scores")


def _reset_in_a_child_forked_while(
    hold: Callable[[], Any], env: Any, ok: Callable[[], bool]
) -> int:
    """Fork while another thread is inside ``hold()`` (a context manager), reset ``env`` in the
    child (10 s at most) and return its exit code: 0 when ``ok()`` there, 1 when the reset
    failed or waited too long."""
    inside, leave = threading.Event(), threading.Event()

    def inside_hold() -> None:
        with hold():
            inside.set()
            leave.wait()

    thread = threading.Thread(target=inside_hold)
    thread.start()
    try:
        assert inside.wait(10)
        with warnings.catch_warnings():
            # Python >= 3.12 warns that this process has threads: that is the case tested.
            warnings.filterwarnings(
                "ignore", "This process .* is multi-threaded", DeprecationWarning
            )
            pid = os.fork()
        if pid == 0:  # pragma: no cover - the child (coverage does not follow os.fork)
            code = 1
            try:
                signal.alarm(10)  # a reset waiting on a lock ends here, as a failure
                with _parsed.parsing_once():
                    env.reset(seed=0)
                code = 0 if ok() else 2
            finally:
                os._exit(code)
    finally:
        leave.set()
        thread.join()
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def test_a_worker_forked_while_another_thread_parses_does_not_wait_for_it() -> None:
    """A worker forks from a thread of this process while another thread may be building an env
    (another runner's, under ``parsing_once``): the worker's resets neither wait for that
    thread's lock nor keep pandas patched after them."""
    env = make_env()
    original = pandas.read_csv

    @contextlib.contextmanager
    def parsing() -> Iterator[None]:
        with _parsed.parsing_once(), _parsed._lock:
            yield

    try:
        assert (
            _reset_in_a_child_forked_while(parsing, env, lambda: pandas.read_csv is original) == 0
        )
    finally:
        env.close()


def test_a_worker_forked_while_a_thread_first_uses_tempfile_does_not_wait_for_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A run's first channel folder cleanup asks tempfile for its folder in a thread while the
    run's first worker may fork: that worker's first reset of a chronic not parsed before writes
    it with ``tempfile.mkstemp``, which must not wait for the lock that thread held (it waited
    forever: a README command hung in CI)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # nothing parsed yet: written anew
    # nor in this process's memory (a test before, playing in its threads, filled it)
    monkeypatch.setattr(_parsed, "_parsed", OrderedDict())
    monkeypatch.setattr(_parsed, "_size", 0)
    env = make_env()
    # A process that has not used tempfile yet: its first use takes tempfile's lock.
    monkeypatch.setattr(tempfile, "tempdir", None)
    monkeypatch.setattr(tempfile, "_name_sequence", None)
    try:
        code = _reset_in_a_child_forked_while(
            lambda: tempfile._once_lock,  # type: ignore[attr-defined]  # what that first use holds
            env,
            lambda: any(tmp_path.rglob("*.pickle")),  # the parsed chronics were written
        )
        assert code == 0
    finally:
        env.close()
