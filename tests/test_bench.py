"""``asyncrunner bench`` runs on a tiny workload and its JSON has every documented field.

No timing is asserted: benchmarks are not tests.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

import pytest

TIMING = {
    "seconds": float,
    "episodes": int,
    "steps": int,
    "steps_per_s": float,
    "episodes_per_s": float,
}
LAG = {"p50": float, "p99": float, "max": float, "samples": int}
pytestmark = pytest.mark.slow  # `asyncrunner bench` in subprocesses

RUNS = ("cold", "warm", "warm_no_sinks", "warm_all_sinks")


def _bench(*args: str) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "asyncrunner",
            "bench",
            "--episodes",
            "2",
            "--workers",
            "2",
            "--max-iter",
            "10",
            "--json",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr
    return done, json.loads(done.stdout)


def _check_timing(part: dict[str, Any], episodes: int, steps: int) -> None:
    for key, kind in TIMING.items():
        assert isinstance(part[key], kind), (key, part[key])
    assert part["episodes"] == episodes
    assert part["steps"] == steps
    assert part["seconds"] > 0 and part["steps_per_s"] > 0 and part["episodes_per_s"] > 0


@pytest.fixture(scope="module")
def report() -> dict[str, Any]:
    return _bench("--episodes", "2", "--workers", "2", "--max-iter", "10")[1]


def test_config(report: dict[str, Any]) -> None:
    assert list(report) == [
        "version",
        "config",
        "lag_probe",
        "bare_loop",
        "bare_loops_at_once",
        "grid2op",
        "asyncrunner",
        "ratios",
        "projection",
        "sweep",
        "streaming_cost",
        "agreement",
        "errors",
        "memory",
    ]
    assert report["version"] == 1
    cfg = report["config"]
    assert cfg["env"] == "l2rpn_case14_sandbox" and cfg["test"] is True
    assert isinstance(cfg["backend"], str) and "_" not in cfg["backend"]
    assert cfg["agent"] == "DoNothingAgent"
    assert (cfg["episodes"], cfg["workers"], cfg["max_iter"], cfg["seed"]) == (2, 2, 10, 0)
    assert cfg["sweep_workers"] == [2]
    assert cfg["loop"] == "asyncio" and cfg["copy_env"] is False and cfg["repeat"] == 3
    assert cfg["episode_ids"] == [0, 1]
    for key in ("env_seeds", "agent_seeds"):
        assert len(cfg[key]) == 2 and all(isinstance(s, int) for s in cfg[key])
    assert isinstance(cfg["cpu_count"], int)
    assert set(cfg["versions"]) == {"python", "grid2op", "lightsim2grid", "anyio", "asyncrunner"}
    assert isinstance(cfg["versions"]["grid2op"], str)


def test_no_errors(report: dict[str, Any]) -> None:
    assert report["errors"] == {"grid2op": None, "asyncrunner": None}


def test_lag_probe(report: dict[str, Any]) -> None:
    probe = report["lag_probe"]
    assert probe["enabled"] is True and probe["tick_ms"] == 1.0
    assert isinstance(probe["cpu_us_per_wakeup"], float) and probe["cpu_us_per_wakeup"] > 0


def test_contenders(report: dict[str, Any]) -> None:
    # DoNothing on case14 lasts the 10 steps of max_iter: the same work for every contender.
    _check_timing(report["bare_loop"], 2, 20)
    # two forked loops, an episode each (Linux, where the bench's CI runs)
    _check_timing(report["bare_loops_at_once"], 2, 20)
    assert report["bare_loops_at_once"]["processes"] == 2
    _check_timing(report["grid2op"], 2, 20)
    assert report["grid2op"]["nb_process"] == 2
    assert set(report["asyncrunner"]) == set(RUNS)
    for name in RUNS:
        part = report["asyncrunner"][name]
        _check_timing(part, 2, 20)
        lag = part["loop_lag_ms"]
        assert set(lag) == set(LAG)
        assert lag["samples"] > 0
        for key, kind in LAG.items():
            assert isinstance(lag[key], kind), (name, key, lag[key])
        assert 0 <= lag["p50"] <= lag["p99"] <= lag["max"]
        assert isinstance(part["parent_cpu_s"], float) and part["parent_cpu_s"] >= 0
        assert isinstance(part["parent_cpu_us_per_step"], float)
        if name != "cold":  # played three times in turns: the figures are the median run's
            each = part["seconds_each"]
            assert len(each) == 3 and sorted(each)[1] == part["seconds"]
        if name == "warm_no_sinks":
            assert part["first_step_s"] is None and part["first_step_max_s"] is None
        else:
            firsts = part["first_step_s"]
            assert 1 <= len(firsts) <= 2 and all(isinstance(t, float) and t > 0 for t in firsts)
            assert part["first_step_max_s"] == max(firsts)
    sinks = report["asyncrunner"]["warm_all_sinks"]["sinks"]
    assert {"EpisodeDataWriter", "ProgressBar", "LoggingSink", "CallbackSink"} <= set(sinks)


def test_figures(report: dict[str, Any]) -> None:
    ratios = report["ratios"]
    assert set(ratios) == {
        "cold_vs_grid2op",
        "warm_vs_grid2op",
        "cold_vs_bare",
        "warm_vs_bare",
        "cold_vs_bare_at_once",
        "warm_vs_bare_at_once",
        "bare_at_once_vs_bare",
        "all_sinks_vs_no_sinks",
    }
    assert all(isinstance(v, float) and v > 0 for v in ratios.values())
    at_once, bare = report["bare_loops_at_once"]["steps_per_s"], report["bare_loop"]["steps_per_s"]
    assert ratios["bare_at_once_vs_bare"] == pytest.approx(at_once / (2 * bare))
    assert ratios["warm_vs_bare_at_once"] == pytest.approx(
        report["asyncrunner"]["warm"]["steps_per_s"] / at_once
    )
    projection = report["projection"]
    assert set(projection) == {
        "parent_cpu_us_per_step",
        "steps_per_s_per_worker",
        "parent_steps_per_s",
        "workers_fed",
    }
    warm = report["asyncrunner"]["warm"]
    assert projection["parent_cpu_us_per_step"] == warm["parent_cpu_us_per_step"]
    assert projection["steps_per_s_per_worker"] == pytest.approx(warm["steps_per_s"] / 2)
    assert projection["workers_fed"] == pytest.approx(
        1e6 / warm["parent_cpu_us_per_step"] / projection["steps_per_s_per_worker"]
    )
    (row,) = report["sweep"]  # no sweep: the one worker count
    assert row["workers"] == 2 and row["warm_steps_per_s"] == warm["steps_per_s"]
    assert row["limit_steps_per_s"] == pytest.approx(2 * report["bare_loop"]["steps_per_s"])
    cost = report["streaming_cost"]
    assert set(cost) == {
        "sinks",
        "no_sinks_steps_per_s",
        "all_sinks_steps_per_s",
        "ratio",
        "slowdown_percent",
    }
    assert cost["ratio"] == ratios["all_sinks_vs_no_sinks"]
    assert cost["sinks"] == report["asyncrunner"]["warm_all_sinks"]["sinks"]
    assert isinstance(cost["slowdown_percent"], float)
    agreement = report["agreement"]
    assert agreement["steps_agree"] is True and agreement["results_agree"] is True
    assert agreement["asyncrunner_steps"] == agreement["grid2op_steps"] == 20
    assert agreement["bare_loop_steps"] == 20
    assert "agree" in agreement["detail"]
    memory = report["memory"]
    assert set(memory) == {
        "ru_maxrss_mb",
        "rss_start_mb",
        "rss_before_asyncrunner_mb",
        "rss_after_asyncrunner_mb",
        "peak_during_asyncrunner_mb",
    }
    assert isinstance(memory["ru_maxrss_mb"], float) and memory["ru_maxrss_mb"] > 0
    for value in memory.values():
        assert value is None or (isinstance(value, float) and value > 0)


def test_table(report: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    from asyncrunner._cli._bench_report import print_report as _print_report

    _print_report(report)
    out = capsys.readouterr().out
    for text in (
        "bare loop",
        "2 bare loops at once",
        "AsyncRunner / (2 bare loops at once)",
        "grid2op Runner",
        "AsyncRunner cold",
        "AsyncRunner warm",
        "AsyncRunner / grid2op Runner",
        "loop lag",
        "first step",
        "parent CPU",
        "projection: ",
        "streaming cost",
        "parent memory",
        "results: AsyncRunner and grid2op's Runner agree",
    ):
        assert text in out, text


def test_skip_grid2op_no_probe_trio_copy_env() -> None:
    report = _bench(
        "--episodes",
        "1",
        "--workers",
        "1",
        "--max-iter",
        "5",
        "--skip-grid2op",
        "--no-lag-probe",
        "--agent",
        "RandomAgent",
        "--loop",
        "trio",
        "--copy-env",
        "--repeat",
        "1",
    )[1]
    assert report["config"]["loop"] == "trio" and report["config"]["agent"] == "RandomAgent"
    assert report["config"]["copy_env"] is True and report["config"]["repeat"] == 1
    assert report["grid2op"] is None
    assert (
        report["ratios"]["cold_vs_grid2op"] is None and report["ratios"]["warm_vs_grid2op"] is None
    )
    assert isinstance(report["ratios"]["warm_vs_bare"], float)
    assert report["lag_probe"] == {"enabled": False, "tick_ms": 1.0, "cpu_us_per_wakeup": None}
    steps = report["bare_loop"]["steps"]
    assert 1 <= steps <= 5
    assert report["bare_loops_at_once"]["processes"] == 1
    assert report["bare_loops_at_once"]["steps"] == steps
    assert report["ratios"]["bare_at_once_vs_bare"] == pytest.approx(
        report["bare_loops_at_once"]["steps_per_s"] / report["bare_loop"]["steps_per_s"]
    )
    for name in RUNS:
        part = report["asyncrunner"][name]
        assert part["loop_lag_ms"] is None
        assert part["steps"] == steps  # seeded: the same random actions everywhere
        if name != "cold":
            assert part["seconds_each"] == [part["seconds"]]
    agreement = report["agreement"]
    assert agreement["steps_agree"] is None and agreement["grid2op_steps"] is None
    assert agreement["asyncrunner_steps"] == steps
    # the table copes with what is missing
    from asyncrunner._cli._bench_report import print_report as _print_report

    _print_report(report)


def test_workers_sweep_and_plot(tmp_path: Any) -> None:
    plot = tmp_path / "bench.png"
    report = _bench(
        "--episodes", "2", "--max-iter", "5", "--workers", "2,1", "--skip-grid2op",
        "--no-lag-probe", "--plot", str(plot),
    )[1]  # fmt: skip
    assert report["config"]["workers"] == 2 and report["config"]["sweep_workers"] == [1, 2]
    rows = report["sweep"]
    assert [r["workers"] for r in rows] == [1, 2]
    keys = {
        "workers", "limit_steps_per_s", "grid2op_steps_per_s", "cold_steps_per_s",
        "warm_steps_per_s", "warm_vs_limit", "warm_vs_grid2op", "parent_cpu_us_per_step",
    }  # fmt: skip
    for row in rows:
        assert set(row) == keys and row["grid2op_steps_per_s"] is None
        for key in ("limit_steps_per_s", "cold_steps_per_s", "warm_steps_per_s"):
            assert isinstance(row[key], float) and row[key] > 0
    assert rows[1]["limit_steps_per_s"] == pytest.approx(2 * rows[0]["limit_steps_per_s"])
    assert plot.stat().st_size > 10_000 and plot.read_bytes()[:4] == b"\x89PNG"
    from asyncrunner._cli._bench_report import print_report as _print_report

    _print_report(report)  # the sweep table copes with grid2op's missing figures


def test_bad_arguments() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "asyncrunner", "bench", "--workers", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "asyncrunner bench: error" in done.stderr
    for args, message in (
        (["--workers", "1,1"], "each worker count once"),
        # before anything forks (it forked them for the bare loops, then ran grid2op's Runner)
        (["--workers", "1,100000"], "--workers: workers=100000 asks for up to 100000"),
        (["--plot", "b.svg"], "PNG"),
        (["--repeat", "0"], "--repeat"),
        (["--episodes", "1", "--workers", "1,2"], "--episodes 1 leaves workers idle"),
    ):
        done = subprocess.run(
            [sys.executable, "-m", "asyncrunner", "bench", *args],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 2 and message in done.stderr, done.stderr
    done = subprocess.run(
        [sys.executable, "-m", "asyncrunner", "bench", "--agent", "NoSuchAgent", "--skip-grid2op"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "NoSuchAgent" in done.stderr


def test_the_bare_loop_plays_what_grid2op_plays(wheel_env: Any, grid2op_reference: Any) -> None:
    # Each episode on its own copy: l2rpn_idf_2023's opponent keeps state across episodes, and
    # one env reused for all of them played 93 steps of the second episode where grid2op's
    # Runner plays 300 (the first one ends in a game over).
    from grid2op.Agent import DoNothingAgent

    from asyncrunner._cli._bench_contenders import Plan, bare_loop
    from asyncrunner._cli._common import derive_seeds

    env = wheel_env("l2rpn_idf_2023")
    env_seeds, agent_seeds = derive_seeds(0, 2)
    assert env_seeds is not None and agent_seeds is not None
    plan = Plan(2, 1, 300, [0, 1], env_seeds, agent_seeds)
    _, played = bare_loop(env, DoNothingAgent, plan)
    expected = grid2op_reference(env, DoNothingAgent, nb_episode=2, **plan.kwargs())
    assert [(name, steps, repr(reward)) for name, steps, reward in played] == [
        (name, steps, repr(reward)) for _, name, reward, steps, _ in expected
    ]
    assert [steps for _, steps, _ in played] == [123, 300]


def test_grid2ops_runner_plays_an_agent_given_as_a_factory_or_an_instance(env: Any) -> None:
    # `--agent module:make_agent` (what the CLI's hint says for an agent taking arguments): the
    # bench gave grid2op's Runner agentInstance beside its default agentClass, and it refused.
    import functools

    from grid2op.Agent import RandomAgent

    from asyncrunner._cli._bench_contenders import Plan, grid2op_runner

    plan = Plan(2, 1, 4, [0, 1], [0, 1], [0, 1])
    make = functools.partial(RandomAgent, env.action_space)
    played = [
        grid2op_runner(env, agent, plan)[1] for agent in (RandomAgent, lambda space: make(), make())
    ]
    assert played[1] == played[2] == played[0] and len(played[0]) == 2


class _DiesAtFirstAct:  # an agent class whose first act ends its process
    def __init__(self, action_space: Any) -> None:
        pass

    def seed(self, seed: int) -> None:
        pass

    def reset(self, obs: Any) -> None:
        pass

    def act(self, *args: Any) -> Any:
        os._exit(3)


def test_bare_loops_at_once_share_the_episodes_and_survive_a_dead_loop(env: Any) -> None:
    from grid2op.Agent import DoNothingAgent

    from asyncrunner._cli._bench_contenders import Plan, bare_loops_at_once

    plan = Plan(3, 2, 5, [0, 1, 0], [1, 2, 3], [4, 5, 6])
    timing = bare_loops_at_once(env, DoNothingAgent, plan)
    assert timing is not None
    assert (timing["processes"], timing["episodes"], timing["steps"]) == (2, 3, 15)
    # a loop whose process dies sends nothing: no figure, and the bench goes on
    assert bare_loops_at_once(env, _DiesAtFirstAct, plan) is None


class _Sleeps(_DiesAtFirstAct):  # an agent class whose first act takes a minute
    def act(self, *args: Any) -> Any:
        time.sleep(60)


@pytest.mark.parametrize("starting", [False, True], ids=["playing", "starting"])
def test_bare_loops_at_once_stopped_by_a_signal_end_at_once(
    env: Any, starting: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # SIGTERM to the bench alone (`kill`, `docker stop`) as its loops played at once: it said
    # "terminated" and waited for the loops to end (minutes with whole episodes). As they
    # started (the second forked, the signal before its start returned), those started lived
    # on. (This call's processes, not `multiprocessing.active_children()`: in the clean-clone
    # CI two other processes of the pytest worker were alive there; the module passes alone.)
    import signal
    from multiprocessing.context import ForkProcess

    from asyncrunner._cli._bench_contenders import Plan, bare_loops_at_once

    class Stop(Exception):
        pass

    def stop(signum: int, frame: object) -> None:
        raise Stop

    start, started = ForkProcess.start, list[Any]()

    def recorded(self: Any) -> None:
        start(self)
        started.append(self)
        if starting and len(started) == 2:
            raise Stop

    monkeypatch.setattr(ForkProcess, "start", recorded)
    previous = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, 0 if starting else 1.0)  # (the loops playing by then)
    began = time.monotonic()
    try:
        with pytest.raises(Stop):
            bare_loops_at_once(env, _Sleeps, Plan(2, 2, 5, [0, 1], [1, 2], [3, 4]))
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert len(started) == 2 or not starting
    assert [p for p in started if p.is_alive()] == []
    assert time.monotonic() - began < 30  # stopped, not waited for (their act takes a minute)


def test_without_grid2op_asyncrunner_runs_that_differ_disagree() -> None:
    # `--skip-grid2op` exited 0 when the AsyncRunner runs played different rewards per episode.
    from asyncrunner._cli._bench_report import agreement

    rows = [("0000", 5, 1.5), ("0001", 5, 2.0)]
    other = [("0000", 5, 1.5), ("0001", 5, 2.5)]
    same = agreement(rows, None, {"cold": rows, "warm": list(reversed(rows))})
    differ = agreement(rows, None, {"cold": rows, "warm": other})
    assert (same["steps_agree"], same["results_agree"]) == (None, None)
    assert (differ["steps_agree"], differ["results_agree"]) == (None, False)
    assert "DIFFER" in differ["detail"] and "DIFFER" not in same["detail"]


@pytest.mark.parametrize(
    ("loop", "phase", "ctrl_c"),
    [("asyncio", "AsyncRunner: cold", False), ("trio", "AsyncRunner: cold", False),
     ("asyncio", "sweep: grid2op", False), ("asyncio", "at once", True),
     ("trio", "AsyncRunner: cold", True)],
)  # fmt: skip
def test_sigterm_stops_the_bench_as_ctrl_c_does(
    tmp_path: Any, loop: str, phase: str, ctrl_c: bool
) -> None:
    # `timeout`, a batch system's time limit: the bench ended at once and left its runners'
    # temporary folders (raised inside the event loop, the sinks failed: it cancels the runs).
    # Ctrl-C, to the process group as a terminal sends it, during the bare loops at once: each
    # forked loop printed its traceback.
    import signal
    import time

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    err = tmp_path / "err.txt"
    with err.open("w") as stderr:
        bench = subprocess.Popen(
            # (the test env's chronics have 575 steps: 8 episodes keep each loop at once
            # playing for seconds)
            [sys.executable, "-m", "asyncrunner", "bench", "--episodes", "8" if ctrl_c else "2",
             "--repeat", "1", "--no-lag-probe", "--loop", loop,
             # (a sweep: grid2op's Runner again, after the AsyncRunner runs)
             *(["--workers", "1,2"] if "sweep" in phase else ["--skip-grid2op"])],
            stdout=subprocess.DEVNULL, stderr=stderr, env={**os.environ, "TMPDIR": str(tmp)},
            start_new_session=True,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        while phase not in err.read_text() and bench.poll() is None:
            assert time.monotonic() < deadline, err.read_text()
            time.sleep(0.1)
        time.sleep(0.5)  # its workers or loops playing, its folders made
        if ctrl_c:
            os.killpg(bench.pid, signal.SIGINT)
        else:
            bench.send_signal(signal.SIGTERM)
        assert bench.wait(60) == (130 if ctrl_c else 143), err.read_text()
    finally:
        bench.kill()
    text = err.read_text()
    assert text.endswith(f"asyncrunner bench: {'interrupted' if ctrl_c else 'terminated'}\n")
    assert "Traceback" not in text
    assert not list(tmp.iterdir())
    time.sleep(1)
    assert subprocess.run(["pgrep", "-s", str(bench.pid)], capture_output=True).stdout == b""
