"""Saving a short episode of a long chronic: the padding grid2op adds costs almost nothing.

grid2op pads an episode's arrays to its chronic's length; the writers keep only the rows played
and splice cached compressed padding into each ``.npz``. What ``np.load`` and
``EpisodeData.from_disk`` read must be exactly what the whole arrays were.
"""

from __future__ import annotations

import io
import threading
import tracemalloc
import warnings
import zipfile
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
from grid2op.Agent import DoNothingAgent, RandomAgent
from grid2op.Episode import EpisodeData

from asyncrunner import AsyncRunner
from asyncrunner._model import EpisodeStarted, Event, StepBatch
from asyncrunner._plan._layout import sync
from asyncrunner.sinks import CallbackSink, CompactEpisodeWriter, _npz
from asyncrunner.sinks._buffer import EpisodeBuffer
from asyncrunner.sinks._npz import Padded, npz_bytes

from .helpers import CutsLines

SHORT: dict[str, Any] = dict(nb_episode=2, episode_id=[0, 1], env_seeds=[3, 4], agent_seeds=[5, 6])


def _savez(**arrays: Any) -> bytes:
    out = io.BytesIO()
    np.savez_compressed(out, **arrays)
    return out.getvalue()


def _head(rng: np.random.Generator, dtype: Any, shape: tuple[int, ...]) -> np.ndarray:
    if dtype == np.bool_:
        return rng.random(shape) < 0.5
    head = rng.normal(size=shape).astype(dtype)
    head[rng.random(shape) < 0.2] = np.nan
    return head


@pytest.mark.parametrize(
    ("dtype", "fill"),
    [(np.float32, np.nan), (np.float64, np.nan), (np.float32, 0.0), (np.bool_, True)],
)
@pytest.mark.parametrize(
    ("played", "rows", "width"),
    [
        (4, 8064, 536),
        (0, 9, 3),
        (6, 6, 2),
        (1, 2, 1),
        (5, 69, None),
        (3, 3 + 2**10, 4),
        (2, 3 * 2**14 + 7, 32),
    ],
)
@pytest.mark.parametrize("deflater", ["isal", "zlib"])
def test_padded_npz_reads_as_savez_compressed(
    dtype: Any,
    fill: Any,
    played: int,
    rows: int,
    width: int | None,
    deflater: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if deflater == "isal":
        from isal import isal_zlib

        assert (
            vars(_npz)["_deflater"] is isal_zlib
        )  # installed with asyncrunner here: the fast one is used
    else:  # where isal has no wheel
        monkeypatch.setattr(_npz, "_deflater", zlib)
    rng = np.random.default_rng(played + rows)
    row = () if width is None else (width,)
    padded = Padded(_head(rng, dtype, (played, *row)), rows, np.full(row, fill, dtype=dtype))
    whole = padded.full()
    assert whole.shape == (rows, *row)
    ours = npz_bytes(data=padded, plain=whole[:played])
    assert zipfile.ZipFile(io.BytesIO(ours)).testzip() is None  # every member's CRC-32
    theirs = _savez(data=whole, plain=whole[:played])
    for name in ("data.npy", "plain.npy"):  # the same .npy files, byte for byte
        assert zipfile.ZipFile(io.BytesIO(ours)).read(name) == (
            zipfile.ZipFile(io.BytesIO(theirs)).read(name)
        )
    loaded = np.load(io.BytesIO(ours))
    assert loaded["data"].dtype == whole.dtype and loaded["data"].shape == whole.shape
    assert loaded["data"].tobytes() == whole.tobytes()  # NaN patterns included


def test_padded_npz_of_a_two_column_fill() -> None:
    """Rows of two columns (a compact episode's legal and ambiguous flags): each column pads
    with its own value."""
    head = np.array([[True, True], [False, True], [True, False]])
    padded = Padded(head, 100, np.array([True, False]))
    assert np.load(io.BytesIO(npz_bytes(data=padded)))["data"].tobytes() == (
        np.concatenate((head, np.tile([True, False], (97, 1)))).tobytes()
    )


def test_npz_members_are_dated_1980_so_the_same_arrays_give_the_same_bytes() -> None:
    # np.savez dates members with the time of writing: two writes of one episode would differ
    # (and so would their checksums in asyncrunner.json) across a 2-second boundary.
    data = npz_bytes(data=np.arange(6.0), padded=Padded(np.ones((2, 3)), 9, np.zeros(3)))
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        assert [m.date_time for m in archive.infolist()] == [(1980, 1, 1, 0, 0, 0)] * 2


@pytest.mark.slow
def test_padded_npz_beyond_4_gib() -> None:
    """Zip64: an array of more than 4 GiB (a long chronic, a wide grid) reads back whole."""
    head = np.arange(12, dtype=np.float32).reshape(3, 4)
    rows = 2**28 + 5  # 4 GiB and 80 bytes of float32
    data = npz_bytes(data=Padded(head, rows, np.full(4, np.nan, dtype=np.float32)))
    assert len(data) < 2**24
    with zipfile.ZipFile(io.BytesIO(data)) as archive, archive.open("data.npy") as member:
        assert archive.getinfo("data.npy").file_size > 2**32
        assert np.lib.format.read_magic(member) == (1, 0)
        shape, fortran, dtype = np.lib.format.read_array_header_1_0(member)
        assert (shape, fortran, dtype) == ((rows, 4), False, np.dtype(np.float32))
        assert np.frombuffer(member.read(head.nbytes), dtype=np.float32).tobytes() == (
            head.tobytes()
        )
        nan_row = np.full(4, np.nan, dtype=np.float32).tobytes()
        left = (rows - 3) * 16
        while left:  # zipfile checks the CRC-32 at the end
            chunk = member.read(min(left, 2**26))
            assert chunk == nan_row * (len(chunk) // 16)
            left -= len(chunk)
        assert member.read() == b""


async def _events(tmp_path: Path) -> tuple[list[Event], list[Any]]:
    from .conftest import make_env

    events: list[Event] = []
    env = make_env("rte_case14_opponent")
    async with AsyncRunner(env, agent=RandomAgent, workers=1) as runner:
        results = await runner.run(
            **SHORT,
            path_save=tmp_path,
            add_detailed_output=True,
            sinks=[CallbackSink(events.append)],
        )
    env.close()
    return events, results


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_short_episode_saved_whole(tmp_path: Path) -> None:
    """Every saved array of a short episode of a long chronic reads back padded to its length,
    equal to the EpisodeData built in memory from the whole arrays."""
    _, results = await _events(tmp_path)
    for result in results:
        assert 0 < result.nb_time_step < result.max_ts  # short: mostly padding
        detail = result.episode_data
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            saved = EpisodeData.from_disk(str(tmp_path), Path(result.path).name)
        for name in ("actions", "env_actions", "observations", "attacks"):
            ours = getattr(saved, name).collection
            assert ours.shape[0] == result.max_ts + (name == "observations")
            assert ours.tobytes() == getattr(detail, name).collection.tobytes(), name
        for name in ("rewards", "disc_lines", "times"):
            ours = np.asarray(getattr(saved, name))
            assert ours.shape[0] == result.max_ts
            assert ours.tobytes() == np.asarray(getattr(detail, name)).tobytes(), name
        assert saved.legal is None and len(detail.legal) == result.max_ts  # as grid2op's


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_an_endless_chronics_compact_episode_holds_the_rows_played(tmp_path: Path) -> None:
    """ChangeNothing has no end (max_episode_duration() is 2**31 - 1): nothing to pad up to,
    the CompactEpisodeData holds the rows played (grid2op's cannot preallocate that many)."""
    from grid2op.Chronics import ChangeNothing
    from grid2op.Episode import CompactEpisodeData

    from .conftest import make_env

    env = make_env(chronics_class=ChangeNothing)
    try:
        async with AsyncRunner(env, agent=CutsLines, workers=1) as runner:
            (result,) = await runner.run(
                1, env_seeds=[1], agent_seeds=[2], sinks=[CompactEpisodeWriter(tmp_path)]
            )
    finally:
        env.close()
    assert result.ok and 0 < result.nb_time_step < 50 and result.max_ts == 0
    saved = tmp_path / "CompactEpisodeData" / f"{result.name}.npz"
    with np.load(saved) as data:
        assert data["actions"].shape[0] == data["rewards"].shape[0] == result.nb_time_step
        assert data["observations"].shape[0] == result.nb_time_step + 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = CompactEpisodeData.from_disk(tmp_path, result.name)
    assert loaded.meta["nb_timestep_played"] == result.nb_time_step


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_buffer_holds_the_rows_played_only(tmp_path: Path) -> None:
    """While a short episode plays, its buffer does not hold the chronic's length of rows."""
    events, _ = await _events(tmp_path)
    started = next(e for e in events if isinstance(e, EpisodeStarted) and e.index == 0)
    batches = [e for e in events if isinstance(e, StepBatch) and e.index == 0]
    width = started.observation.shape[0]
    whole = (started.max_ts + 1) * width * 4  # the observations alone, padded
    tracemalloc.start()
    try:
        buffer = EpisodeBuffer(started)
        for batch in batches:
            buffer.add(batch)
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert held < whole / 10
    assert buffer.arrays(started.max_ts)["observations"].shape == (started.max_ts + 1, width)


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_buffer_on_an_earlier_ones_arrays_gives_the_same_arrays(tmp_path: Path) -> None:
    """A worker's next episode fills the arrays its last one released: what it saves is what a
    buffer of its own gives, whatever the earlier rows held."""
    events, _ = await _events(tmp_path)

    def of(index: int, spare: dict[str, np.ndarray] | None = None) -> EpisodeBuffer:
        started = next(e for e in events if isinstance(e, EpisodeStarted) and e.index == index)
        buffer = EpisodeBuffer(started, spare)
        for batch in events:
            if isinstance(batch, StepBatch) and batch.index == index:
                buffer.add(batch)
        return buffer

    spare = of(0).release()
    for arr in spare.values():
        arr[...] = 7  # rows the next episode does not play must not show
    reused, own = of(1, spare), of(1)
    max_ts = reused.started.max_ts
    expected = own.arrays(max_ts)
    for name, arr in reused.arrays(max_ts).items():
        assert arr.tobytes() == expected[name].tobytes(), name
    assert reused.n == own.n
    again = reused.release()
    assert all(again[name] is spare[name] for name in spare)  # reused, not allocated


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_worker_saves_its_next_episode_in_its_last_ones_arrays(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker (a thread here, so that this process is the worker) takes the arrays its last
    saved episode released, and releases them again: one set, not one per episode."""
    from asyncrunner._engine import _worker

    from .conftest import make_env

    monkeypatch.setattr(_worker, "_SPARE", [])
    env = make_env()
    try:
        with ThreadPoolExecutor(1) as executor:
            async with AsyncRunner(
                env, agent=DoNothingAgent, workers=1, executor=executor
            ) as runner:
                results = await runner.run(3, max_iter=70, path_save=tmp_path / "saved")
    finally:
        env.close()
    assert [r.nb_time_step for r in results] == [70, 70, 70]  # past the first 64 rows
    assert len(_worker._SPARE) == 1  # taken by each episode, given back at its end
    (spare,) = _worker._SPARE
    assert len(spare["observations"]) > 70


def test_sync_keeps_its_threads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Flushing an episode's files does not start a thread per file each time (CPU)."""
    paths = []
    for i in range(14):
        (tmp_path / f"{i}.npz").write_bytes(b"saved")
        paths.append(str(tmp_path / f"{i}.npz"))
    paths.append(str(tmp_path))
    sync(paths)
    started: list[threading.Thread] = []
    start = threading.Thread.start

    def counted(thread: threading.Thread) -> None:
        started.append(thread)
        start(thread)

    monkeypatch.setattr(threading.Thread, "start", counted)
    for _ in range(3):
        sync(paths)
    assert len(started) < len(paths)


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_batches_whose_arrays_no_sink_reads_leave_rarely_and_every_row_is_saved(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each batch costs this process CPU: one whose arrays no sink reads waits (up to 0.5 s, or
    4096 steps), while a saving worker's buffer still takes its rows every 64 steps."""
    from asyncrunner._engine import _batch

    # Batches leave by size or at the episode's end only (the workers fork after this).
    monkeypatch.setattr(_batch, "_BATCH_SECONDS", 1e9)
    monkeypatch.setattr(_batch, "_QUIET_SECONDS", 1e9)
    from .conftest import make_env

    env = make_env()
    sizes: dict[bool, list[int]] = {}
    saved: dict[bool, Path] = {}
    try:
        for reads in (True, False):
            seen: list[int] = []

            def count(event: Event, seen: list[int] = seen) -> None:
                if isinstance(event, StepBatch):
                    seen.append(len(event))

            sink = CallbackSink(count, needs_steps=reads)
            async with AsyncRunner(env, agent=DoNothingAgent, workers=1, sinks=[sink]) as runner:
                with anyio.fail_after(180):
                    (result,) = await runner.run(
                        1, max_iter=200, env_seeds=[0], agent_seeds=[0], episode_id=[0],
                        path_save=tmp_path / str(reads),
                    )  # fmt: skip
            assert result.nb_time_step == 200 and result.path is not None
            sizes[reads], saved[reads] = seen, Path(result.path)
    finally:
        env.close()
    assert sizes == {True: [64, 64, 64, 8], False: [200]}
    for name in ("actions", "env_modifications", "observations", "rewards", "opponent_attack"):
        with np.load(saved[True] / f"{name}.npz") as a, np.load(saved[False] / f"{name}.npz") as b:
            np.testing.assert_array_equal(a["data"], b["data"], err_msg=name)
    name = "disc_lines_cascading_failure.npz"
    assert (saved[True] / name).read_bytes() == (saved[False] / name).read_bytes()


def test_rows_are_filled_as_to_vect_lays_them_out(wheel_env: Any) -> None:
    """``fill`` (each saved row of observations, actions, the env's actions and attacks) gives
    exactly ``to_vect``'s floats, through its per-class layout and through its one-by-one path
    for an object that does not fit it."""
    from asyncrunner._engine._batch import fill

    env = wheel_env("rte_case14_opponent").copy()
    try:
        obs = env.reset(seed=1, options={"time serie id": 0})
        attack = env._opponent_action_space({"set_line_status": [(3, -1)]})
        dispatch = env.action_space(
            {"redispatch": [(0, 1.5)], "set_bus": {"lines_or_id": [(2, 2)]}}
        )
        for _ in range(2):  # the layouts made, then used
            obs, *_ = env.step(dispatch)
            # the env's action holds injections (loads, generators) in its _dict_inj
            assert env._env_modification._dict_inj
            for thing in (obs, dispatch, env._env_modification, attack, env.action_space({})):
                row = np.full(thing.size(), -1.0, dtype=np.float32)
                fill(row, thing)
                assert row.tobytes() == thing.to_vect().astype(np.float32).tobytes()
        # a fresh action's attributes that grid2op builds on first read are read as their
        # default, not built: the action is left as the agent made it
        fresh = env.action_space({})
        row = np.full(env.action_space.n, -1.0, dtype=np.float32)  # size() would build them
        fill(row, fresh)
        lazy = [n for n in type(fresh).attr_list_vect if hasattr(fresh, "_private" + n)]
        assert len(lazy) >= 5
        assert [n for n in lazy if getattr(fresh, "_private" + n) is not None] == []
        assert row.tobytes() == fresh.to_vect().astype(np.float32).tobytes()
        # a subclass's own property is read as to_vect reads it, not as BaseAction's default
        redispatching = type(
            "Redispatching",
            (type(fresh),),
            {"_redispatch": property(lambda self: np.full(self.n_gen, 2.0, dtype=np.float32))},
        )()
        row = np.full(redispatching.size(), -1.0, dtype=np.float32)
        fill(row, redispatching)
        assert row.tobytes() == redispatching.to_vect().astype(np.float32).tobytes()
        assert (row == 2.0).sum() == env.n_gen
        odd = obs.copy()
        odd.gen_p = odd.gen_p.reshape(-1, 1)  # another shape than its class's layout has
        odd.year = np.array([odd.year])
        row = np.full(odd.size(), -1.0, dtype=np.float32)
        fill(row, odd)
        assert row.tobytes() == odd.to_vect().astype(np.float32).tobytes()
    finally:
        env.close()
