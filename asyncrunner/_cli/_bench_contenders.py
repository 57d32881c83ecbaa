"""The contenders of ``asyncrunner bench``: the bare loop, grid2op's Runner, and the AsyncRunner
runs (cold, warm, no sinks, every sink; again beside the loop-lag ticker)."""

from __future__ import annotations

import copy
import logging
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import anyio

from ._bench_report import finite

__all__ = [
    "BareLoopFailed",
    "Plan",
    "Timing",
    "asyncrunner_runs",
    "bare_loop",
    "bare_loops_at_once",
    "grid2op_runner",
    "progress",
]

# The ticker's period: how often the event loop is asked to wake it up.
TICK = 0.001
# Seconds the ticker runs alone first, to measure what its own wake-ups cost this process.
_CALIBRATION = 0.5


def progress(text: str) -> None:
    print(f"bench: {text}", file=sys.stderr, flush=True)


# --- the episodes, the timings, the bare loop and grid2op ---------------------------------------


@dataclass
class Plan:
    """The episodes every contender plays."""

    nb_episode: int
    workers: int
    max_iter: int | None
    episode_ids: list[int] | None
    env_seeds: list[int]
    agent_seeds: list[int]
    copy_env: bool = False  # AsyncRunner(copy_env=...)
    repeat: int = 1  # times each warm AsyncRunner run is played (its figure: the median run)

    def kwargs(self) -> dict[str, Any]:
        return {
            "max_iter": self.max_iter,
            "episode_id": self.episode_ids,
            "env_seeds": self.env_seeds,
            "agent_seeds": self.agent_seeds,
        }


@dataclass
class Timing:
    seconds: float
    episodes: int
    steps: int
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        busy = self.seconds if self.seconds > 0 else float("nan")
        return {
            "seconds": self.seconds,
            "episodes": self.episodes,
            "steps": self.steps,
            "steps_per_s": finite(self.steps / busy),
            "episodes_per_s": finite(self.episodes / busy),
            **self.extra,
        }


class BareLoopFailed(Exception):
    """The agent or env raised in the bare loop; ``detail`` is the traceback."""

    def __init__(self, message: str, detail: str) -> None:
        super().__init__(message)
        self.detail = detail


def _new_agent(agent: Any, action_space: Any) -> Any:
    from grid2op.Agent import BaseAgent

    if isinstance(agent, BaseAgent):
        return copy.copy(agent)
    return agent(action_space)  # a class, or a factory (action_space) -> agent


def bare_loop(env: Any, agent: Any, plan: Plan) -> tuple[Timing, list[tuple[str, int, float]]]:
    """Every episode in turn in this process, each on its own copy of the env (not timed), as
    the runners play them: reset, then act/step. One env reused across episodes would not play
    the same episodes (l2rpn_idf_2023's opponent keeps state from one episode to the next)."""
    from .._engine._envs import fresh_copy

    results = []
    elapsed = 0.0
    for i in range(plan.nb_episode):
        episode = fresh_copy(env)  # the user's env stays as it was
        try:
            options: dict[str, Any] = {}
            if plan.episode_ids is not None:
                options["time serie id"] = plan.episode_ids[i]
            if plan.max_iter is not None:
                options["max step"] = plan.max_iter
            player = _new_agent(agent, episode.action_space)
            start = time.perf_counter()
            obs = episode.reset(seed=plan.env_seeds[i], options=options)
            player.seed(plan.agent_seeds[i])
            player.reset(obs)
            reward, done, steps, cum_reward = float(episode.reward_range[0]), False, 0, 0.0
            while not done:
                obs, reward, done, _info = episode.step(player.act(obs, reward, done))
                steps += 1
                cum_reward += reward
            elapsed += time.perf_counter() - start
            results.append((str(episode.chronics_handler.get_name()), steps, float(cum_reward)))
        finally:
            episode.close()
    timing = Timing(elapsed, plan.nb_episode, sum(r[1] for r in results))
    return timing, results


def bare_loops_at_once(env: Any, agent: Any, plan: Plan) -> dict[str, Any] | None:
    """``plan.workers`` bare loops at once, in forked processes, the episodes dealt round-robin:
    what this machine gives N busy processes (the limit assumes N times one loop). ``None``
    where processes cannot be forked (see ``ForkPool``) or a loop failed."""
    import multiprocessing

    from .._pools._fork import available

    if not available():
        return None
    context = multiprocessing.get_context("fork")
    shares = [list(range(k, plan.nb_episode, plan.workers)) for k in range(plan.workers)]
    loops = []
    received: list[dict[str, Any] | None] = []
    try:
        for share in filter(None, shares):
            receive, send = context.Pipe(duplex=False)
            loop = context.Process(target=_bare_share, args=(env, agent, plan, share, send))
            loops.append((loop, receive))
            loop.start()
            send.close()
        for loop, receive in loops:
            try:
                received.append(receive.recv())
            except EOFError:  # the loop's process died before it sent its timing
                received.append(None)
            loop.join()
            receive.close()
    except BaseException:  # (SIGTERM to the bench alone: it waited for the loops to end, or
        # left those started, as they started)
        for loop, _ in loops:
            if loop.pid is not None:
                loop.kill()
                loop.join()
        raise
    timings = [timing for timing in received if timing is not None]
    if len(timings) < len(received):
        return None
    steps = sum(timing["steps"] for timing in timings)
    # Each loop's rate, added up: a loop whose share ends first (short episodes of uneven
    # length) leaves the others alone for their last episodes, which this slightly flatters.
    rate = sum(timing["steps_per_s"] for timing in timings)
    return {
        "seconds": max(timing["seconds"] for timing in timings),
        "episodes": plan.nb_episode,
        "steps": steps,
        "steps_per_s": finite(rate),
        "episodes_per_s": finite(rate * plan.nb_episode / steps) if steps else None,
        "processes": len(loops),
    }


def _bare_share(env: Any, agent: Any, plan: Plan, share: list[int], send: Any) -> None:
    """A forked process's bare loop over the episodes ``share``; its timing into ``send``."""
    ids = plan.episode_ids
    mine = replace(
        plan,
        nb_episode=len(share),
        workers=1,
        episode_ids=None if ids is None else [ids[i] for i in share],
        env_seeds=[plan.env_seeds[i] for i in share],
        agent_seeds=[plan.agent_seeds[i] for i in share],
    )
    try:
        timing = bare_loop(env, agent, mine)[0].as_dict()
    except Exception:
        timing = None  # no figure: the one-process loop, played first, reports what fails
    except KeyboardInterrupt:  # Ctrl-C reaches the whole process group: the bench says so
        raise SystemExit(130) from None  # (multiprocessing printed each one's traceback)
    send.send(timing)


def grid2op_runner(env: Any, agent: Any, plan: Plan) -> tuple[Timing, list[tuple[str, int, float]]]:
    from grid2op.Agent import BaseAgent
    from grid2op.Runner import Runner

    # (grid2op's Runner defaults agentClass to DoNothingAgent: None with an instance)
    chosen: dict[str, Any] = {"agentClass": agent, "agentInstance": None}
    if isinstance(agent, BaseAgent):
        chosen = {"agentClass": None, "agentInstance": agent}
    elif not isinstance(agent, type):  # a factory: grid2op takes an instance
        chosen = {"agentClass": None, "agentInstance": agent(env.action_space)}
    with tempfile.TemporaryDirectory(prefix="asyncrunner-bench-grid2op-") as path_save:
        start = time.perf_counter()
        runner = Runner(**env.get_params_for_runner(), **chosen)
        rows = runner.run(
            plan.nb_episode, nb_process=plan.workers, path_save=path_save, **plan.kwargs()
        )
        elapsed = time.perf_counter() - start
    # (chronics_path, name, cum_reward, nb_time_step, max_ts)
    results = [(str(row[1]), int(row[3]), float(row[2])) for row in rows]
    timing = Timing(elapsed, len(rows), sum(r[1] for r in results), {"nb_process": plan.workers})
    return timing, results


# --- AsyncRunner --------------------------------------------------------------------------------


class _LagProbe:
    """Sleeps ``TICK`` over and over and records how late each wake-up is (in seconds)."""

    def __init__(self) -> None:
        self.samples: list[float] | None = None

    async def tick(self) -> None:
        while True:
            start = time.perf_counter()
            await anyio.sleep(TICK)
            late = time.perf_counter() - start - TICK
            if self.samples is not None:
                self.samples.append(max(late, 0.0))

    def begin(self) -> None:
        self.samples = []

    def end(self) -> dict[str, Any]:
        samples, self.samples = self.samples or [], None
        return _lag_stats(samples)


def _lag_stats(samples: list[float]) -> dict[str, Any]:
    import numpy as np

    if not samples:
        return {"p50": None, "p99": None, "max": None, "samples": 0}
    ms = np.asarray(samples) * 1000.0
    return {
        "p50": float(np.percentile(ms, 50)),
        "p99": float(np.percentile(ms, 99)),
        "max": float(ms.max()),
        "samples": len(samples),
    }


class _FirstSteps:
    """Callback for a CallbackSink: when each worker's first ``EpisodeStarted`` arrives."""

    def __init__(self, start: float) -> None:
        self.start = start
        self.by_worker: dict[int, float] = {}

    def __call__(self, event: Any) -> None:
        from .._model import EpisodeStarted

        if isinstance(event, EpisodeStarted) and event.worker not in self.by_worker:
            self.by_worker[event.worker] = time.perf_counter() - self.start

    def as_dict(self) -> dict[str, Any]:
        times = sorted(self.by_worker.values())
        return {"first_step_s": times, "first_step_max_s": max(times) if times else None}


def _summary(results: Sequence[Any]) -> list[tuple[str, int, float]]:
    return [(str(r.name), int(r.nb_time_step), float(r.cum_reward)) for r in results]


async def asyncrunner_runs(
    env: Any,
    agent: Any,
    plan: Plan,
    out: dict[str, Any],
    results: dict[str, list[tuple[str, int, float]]],
    probe_info: dict[str, Any],
    *,
    sink_runs: bool = True,
) -> None:
    """The AsyncRunner runs into ``out``; ``sink_runs=False``: cold and warm only (a sweep's)."""
    from .._runner import AsyncRunner
    from ..sinks import CallbackSink

    probe = _LagProbe()

    async def runs(lag_pass: bool, tmp: str) -> None:
        """The AsyncRunner runs, timed into ``out`` or (``lag_pass``) measuring the loop's lag."""

        async def measured(
            name: str,
            start: tuple[float, float],  # (perf_counter, process_time) when its timing began
            run: Callable[..., Any],
            *,
            path_save: str | None,
            sinks: Sequence[Any] | None = (),
            turn: int | None = None,  # a warm run's turn (``plan.repeat``)
        ) -> dict[str, Any] | None:
            # sinks=None: no sink at all; else a first-step clock plus ``sinks``.
            if not lag_pass:
                again = f" ({turn + 1} of {plan.repeat})" if turn is not None else ""
                progress(f"AsyncRunner: {name.replace('_', ' ')}{again}")
            clock = _FirstSteps(start[0])
            # The clock reads no steps: a run's cost is its sinks'.
            attached = [] if sinks is None else [CallbackSink(clock, needs_steps=False), *sinks]
            probe.begin()
            played = await run(
                plan.nb_episode, path_save=path_save, sinks=attached, **plan.kwargs()
            )
            elapsed = time.perf_counter() - start[0]
            cpu = time.process_time() - start[1]  # (cold: with the runner's construction)
            lag = probe.end()
            if lag_pass:
                out[name]["loop_lag_ms"] = lag
                return None
            # Every turn's results, for the agreement: each must play the same.
            results[f"{name} {turn + 1}" if turn else name] = rows = _summary(played)
            steps = sum(r[1] for r in rows)
            extra: dict[str, Any] = {
                **(clock.as_dict() if attached else dict.fromkeys(clock.as_dict())),
                "parent_cpu_s": cpu,
                "parent_cpu_us_per_step": cpu / steps * 1e6 if steps else None,
            }
            return {**Timing(elapsed, len(rows), steps, extra).as_dict(), "loop_lag_ms": None}

        if lag_pass:
            progress("AsyncRunner: the same runs again, with the 1 ms ticker beside them")
        start = (time.perf_counter(), time.process_time())
        async with AsyncRunner(
            env, agent=agent, workers=plan.workers, copy_env=plan.copy_env
        ) as runner:
            cold = await measured("cold", start, runner.run, path_save=os.path.join(tmp, "cold"))
            if cold is not None:
                out["cold"] = cold
            # Not timed: the same episodes once more, so that every warm run finds each worker
            # with the chronics parsed (a worker parses a chronic the first time it plays it:
            # 0.4 s on l2rpn_idf_2023), whichever of them its episodes land on.
            await runner.run(plan.nb_episode, **plan.kwargs())
            # The warm runs ``plan.repeat`` times, in turns: runs of a few seconds vary by 10 to
            # 20 % on a shared machine, and each figure is the run of median time.
            timed: dict[str, list[dict[str, Any]]] = {}
            names: list[str] = []
            for turn in range(1 if lag_pass else plan.repeat):
                folder = os.path.join(tmp, str(turn))
                warm_runs: dict[str, dict[str, Any]] = {
                    "warm": {"path_save": os.path.join(folder, "warm")}
                }
                if sink_runs:
                    every, names = _every_sink(folder)
                    warm_runs["warm_no_sinks"] = {"path_save": None, "sinks": None}
                    warm_runs["warm_all_sinks"] = {
                        "path_save": os.path.join(folder, "all"),
                        "sinks": every,
                    }
                for name, kwargs in warm_runs.items():
                    part = await measured(
                        name,
                        (time.perf_counter(), time.process_time()),
                        runner.run,
                        turn=turn,
                        **kwargs,
                    )
                    if part is not None:
                        timed.setdefault(name, []).append(part)
            for name, parts in timed.items():
                median = sorted(parts, key=lambda part: part["seconds"])[len(parts) // 2]
                out[name] = {**median, "seconds_each": [part["seconds"] for part in parts]}
            if "warm_all_sinks" in out:
                out["warm_all_sinks"]["sinks"] = names

    # Two passes of the same runs: timed with nothing else in this process, then again with the
    # ticker beside them for the loop's lag (its wake-ups take CPU the workers would use).
    for lag_pass in (False, True) if probe_info["enabled"] else (False,):
        with tempfile.TemporaryDirectory(prefix="asyncrunner-bench-") as tmp:
            async with anyio.create_task_group() as ticker:
                if lag_pass:
                    ticker.start_soon(probe.tick)
                    await anyio.sleep(0.05)  # running before anything is measured
                    probe.begin()
                    cpu = time.process_time()
                    await anyio.sleep(_CALIBRATION)
                    cpu = time.process_time() - cpu
                    wakeups = probe.end()["samples"]
                    probe_info["cpu_us_per_wakeup"] = cpu / wakeups * 1e6 if wakeups else None
                await runs(lag_pass, tmp)
                ticker.cancel_scope.cancel()


def _every_sink(tmp: str) -> tuple[list[Any], list[str]]:
    """One of each sink in ``asyncrunner.sinks`` but the CallbackSink every timed run has.

    ``path_save`` adds the EpisodeDataWriter; returned names include both.
    """
    from .. import sinks

    extra: list[Any] = []
    names = ["EpisodeDataWriter"] if hasattr(sinks, "EpisodeDataWriter") else []
    if hasattr(sinks, "CompactEpisodeWriter"):
        extra.append(sinks.CompactEpisodeWriter(os.path.join(tmp, "all-compact")))
        names.append("CompactEpisodeWriter")
    if hasattr(sinks, "ProgressBar"):
        extra.append(sinks.ProgressBar(_devnull_tqdm()))
        names.append("ProgressBar")
    if hasattr(sinks, "LoggingSink"):
        # A logger of its own, enabled at INFO, whose records go to a NullHandler: the sink
        # does all its work (messages, records), nothing is printed.
        logger = logging.Logger("asyncrunner.bench")
        logger.setLevel(logging.INFO)
        logger.addHandler(logging.NullHandler())
        logger.propagate = False
        extra.append(sinks.LoggingSink(logger, level=logging.INFO))
        names.append("LoggingSink")
    names.append("CallbackSink")
    return extra, names


def _devnull_tqdm() -> type:
    from tqdm.auto import tqdm

    class DevNullTqdm(tqdm):  # type: ignore[misc]  # tqdm is untyped (Any base class)
        """tqdm bars that render into os.devnull (the rendering work, no output)."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self._devnull = open(os.devnull, "w")  # closed with the bar
            kwargs.setdefault("file", self._devnull)
            super().__init__(*args, **kwargs)

        def close(self) -> None:
            super().close()
            self._devnull.close()

    return DevNullTqdm
