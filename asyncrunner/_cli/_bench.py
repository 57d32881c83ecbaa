"""``asyncrunner bench``: AsyncRunner side by side with grid2op's Runner, on your env and agent.

One invocation plays the same episodes (same chronics, env seeds and agent seeds, same
``max_iter``) with each contender, one after the other:

1. the bare loop: ``env.reset`` then ``agent.act`` / ``env.step`` in this process, on a copy of the
   env, nothing saved (timed from each reset to the episode's end): what one worker can do at
   most;
2. grid2op's ``Runner`` with ``nb_process=N`` and ``path_save`` (a temporary folder), timed from
   its construction to the return of ``run``;
3. ``AsyncRunner`` with ``workers=N`` and ``path_save``: *cold* (timed from the construction of the
   runner, so the start of its worker processes and the building of their envs count) and *warm*
   (a second ``run()`` on the same runner, to a fresh ``path_save``); a ``CallbackSink`` notes
   when each worker's first episode starts;
4. two more warm runs for the streaming cost: one with no sink at all (no ``path_save``), one
   with every sink ``asyncrunner.sinks`` provides (episode writers, a progress bar writing to
   ``os.devnull``, a ``LoggingSink`` at INFO into a ``NullHandler``, a ``CallbackSink``).

The AsyncRunner runs are then played again (a new runner, cold then warm) with a task beside
them that sleeps 1 ms in a loop and records how late it wakes up: the event loop's lag, what a
web app sharing the loop would feel. The timed runs have no ticker: its thousand wake-ups a
second cost this process CPU that, on a machine with no spare core, the workers would lose. Since every contender plays the
same episodes, a ratio of steps/s is also the ratio of episodes/s (and the inverse ratio of times).

``--json`` prints one JSON object instead of the table (times in seconds, memory in MiB, lags in
milliseconds; ``null`` where a figure was not measured, e.g. ``grid2op`` under ``--skip-grid2op``):

- ``version``: 1, the layout of this object.
- ``config``: ``env``, ``test``, ``backend`` (the backend class used), ``agent``, ``episodes``,
  ``workers``, ``max_iter``, ``seed``, ``loop`` (``"asyncio"`` / ``"trio"``), ``episode_ids``,
  ``env_seeds``, ``agent_seeds`` (what every contender played), ``cpu_count``, ``versions``
  (``python``, ``grid2op``, ``lightsim2grid``, ``anyio``, ``asyncrunner``: str or null).
- ``lag_probe``: ``enabled`` (``--lag-probe``, the default), ``tick_ms`` (1.0),
  ``cpu_us_per_wakeup`` (CPU this process spends per wake-up of the ticker, measured for 0.5 s
  with nothing else running, before the lag pass; null when disabled).
- ``bare_loop``, ``grid2op``: a *timing*: ``seconds``, ``episodes``, ``steps``, ``steps_per_s``,
  ``episodes_per_s``; ``grid2op`` also has ``nb_process``.
- ``asyncrunner``: ``cold``, ``warm``, ``warm_no_sinks``, ``warm_all_sinks``: each a timing plus
  ``loop_lag_ms`` (``p50``, ``p99``, ``max``, ``samples``: the 1 ms ticker's wake-up delays
  beside the same run in the lag pass; null under ``--no-lag-probe``); ``first_step_s`` (for each worker that played, seconds from
  the start, i.e. the runner's construction for ``cold`` and the ``run()`` call otherwise, to
  the parent receiving that worker's first ``EpisodeStarted``, in increasing order; null for
  ``warm_no_sinks``, which has no sink to tell) and ``first_step_max_s`` (the slowest worker);
  ``parent_cpu_s`` (CPU time this process spent during the timed run, all its threads: the
  event loop and the sinks' threads) and ``parent_cpu_us_per_step`` (the same per step
  played: what orchestrating and sinks cost this process, steadier than times on a busy
  machine; on a machine with no spare core it is taken from the workers).
  ``warm_all_sinks`` also has ``sinks`` (the class names attached).
- ``ratios``: ``cold_vs_grid2op``, ``warm_vs_grid2op`` (AsyncRunner steps/s over grid2op's),
  ``cold_vs_bare``, ``warm_vs_bare`` (AsyncRunner steps/s over N × the bare loop's),
  ``all_sinks_vs_no_sinks`` (steps/s with every sink over steps/s with none).
- ``streaming_cost``: ``sinks`` (class names), ``no_sinks_steps_per_s``,
  ``all_sinks_steps_per_s``, ``ratio`` (the same as ``ratios.all_sinks_vs_no_sinks``),
  ``slowdown_percent`` (``100 × (1 - ratio)``).
- ``agreement``: ``steps_agree`` (every AsyncRunner run and grid2op's Runner played the same total
  of steps), ``results_agree`` (and the same (chronic, steps, reward) per episode),
  ``asyncrunner_steps``, ``grid2op_steps``, ``bare_loop_steps`` (totals), ``detail`` (one line).
- ``errors``: ``grid2op``, ``asyncrunner``: null, or the one-line error that stopped that
  contender (its figures are then null; the exit status is 1).
- ``memory``: ``ru_maxrss_mb`` (this process's peak RSS over the whole bench, from
  ``resource.getrusage``), ``rss_start_mb``, ``rss_before_asyncrunner_mb``,
  ``rss_after_asyncrunner_mb`` (``VmRSS`` from ``/proc/self/status``),
  ``peak_during_asyncrunner_mb`` (``VmHWM`` reset before the AsyncRunner runs, where Linux allows).

Exit status: 0, 1 when a contender failed or the contenders' results disagree, 2 for bad
arguments. Benchmark numbers are noisy on a busy machine: compare ratios from one invocation.
"""

from __future__ import annotations

import argparse
import copy
import importlib.metadata
import json
import logging
import os
import platform
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio

from ._common import (
    DEFAULT_ENV,
    QUIET,
    Parser,
    UsageError,
    at_least,
    derive_seeds,
    load_agent,
    make_env,
    parse_max_iter,
)

__all__ = ["main"]

JSON_VERSION = 1
# The ticker's period: how often the event loop is asked to wake it up.
_TICK = 0.001
# Seconds the ticker runs alone first, to measure what its own wake-ups cost this process.
_CALIBRATION = 0.5
_MB = 1024 * 1024
# The top-level keys of the JSON report, in order.
_KEYS = (
    "version",
    "config",
    "lag_probe",
    "bare_loop",
    "grid2op",
    "asyncrunner",
    "ratios",
    "streaming_cost",
    "agreement",
    "errors",
    "memory",
)


# --- command line ----------------------------------------------------------------------------


def build_parser() -> Parser:
    parser = Parser(
        prog="asyncrunner bench",
        description=(
            "Play the same episodes with a bare step loop (one process), grid2op's Runner "
            "(nb_process=N) and AsyncRunner (workers=N, cold then warm), and print steps/s, "
            "episodes/s, their ratios, the event loop's lag, the first-step latency, the cost of "
            "the sinks and this process's memory."
        ),
    )
    parser.add_argument(
        "--env", default=DEFAULT_ENV, help=f"grid2op env name or path (default: {DEFAULT_ENV})"
    )
    parser.add_argument(
        "--test",
        action=argparse.BooleanOptionalAction,
        default=None,
        help=f"grid2op.make(..., test=True); default: on for {DEFAULT_ENV}, off otherwise",
    )
    parser.add_argument(
        "--backend",
        choices=("lightsim", "pandapower"),
        default=None,
        help="power flow backend (default: lightsim when lightsim2grid is installed)",
    )
    parser.add_argument(
        "--agent",
        default="DoNothingAgent",
        metavar="SPEC",
        help=(
            "module:Name, path/to/file.py:Name, or the name of an agent in grid2op.Agent "
            "(default: DoNothingAgent)"
        ),
    )
    parser.add_argument(
        "--episodes", "-n", type=at_least(1), default=6, metavar="N", help="episodes (default: 6)"
    )
    parser.add_argument(
        "--workers",
        "-w",
        type=at_least(1),
        default=2,
        metavar="N",
        help="AsyncRunner workers and grid2op nb_process (default: 2)",
    )
    parser.add_argument(
        "--max-iter",
        type=parse_max_iter,
        default=None,
        metavar="N",
        help="stop each episode after N steps (-1: no limit; default: the env's own)",
    )
    parser.add_argument(
        "--seed",
        type=at_least(0),
        default=0,
        help="derive every episode's env and agent seeds from this one (default: 0)",
    )
    parser.add_argument(
        "--loop",
        choices=("asyncio", "trio"),
        default="asyncio",
        help="event loop the AsyncRunner runs on (default: asyncio)",
    )
    parser.add_argument(
        "--lag-probe",
        action=argparse.BooleanOptionalAction,
        default=True,
        help=(
            "play the AsyncRunner runs a second time beside a 1 ms ticker to measure the event "
            "loop's lag (default: on; --no-lag-probe skips that second pass)"
        ),
    )
    parser.add_argument(
        "--skip-grid2op", action="store_true", help="do not run grid2op's Runner (quicker)"
    )
    parser.add_argument(
        "--json", action="store_true", help="print one JSON object (keys: see the module doc)"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """``asyncrunner bench [options]``; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    with warnings.catch_warnings():
        for message in QUIET:
            warnings.filterwarnings("ignore", message=message)
        try:
            report = _bench(args)
        except UsageError as exc:
            parser.error(str(exc))
        except _BareLoopFailed as exc:
            print(exc.detail, file=sys.stderr, end="")
            print(
                f"asyncrunner bench: the bare loop failed, nothing to compare: {exc}",
                file=sys.stderr,
            )
            return 1
        except KeyboardInterrupt:
            print("asyncrunner bench: interrupted", file=sys.stderr)
            return 130
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_report(report)
    failed = {name: error for name, error in report["errors"].items() if error is not None}
    labels = {"grid2op": "grid2op's Runner", "asyncrunner": "AsyncRunner"}
    for name, error in failed.items():
        print(f"asyncrunner bench: {labels[name]} failed: {error}", file=sys.stderr)
    if failed:
        return 1
    agreement = report["agreement"]
    if agreement["steps_agree"] is False or agreement["results_agree"] is False:
        return 1
    return 0


def _progress(text: str) -> None:
    print(f"bench: {text}", file=sys.stderr, flush=True)


# --- the bench ---------------------------------------------------------------------------------


@dataclass
class _Plan:
    """The episodes every contender plays."""

    nb_episode: int
    workers: int
    max_iter: int | None
    episode_ids: list[int] | None
    env_seeds: list[int]
    agent_seeds: list[int]

    def kwargs(self) -> dict[str, Any]:
        return {
            "max_iter": self.max_iter,
            "episode_id": self.episode_ids,
            "env_seeds": self.env_seeds,
            "agent_seeds": self.agent_seeds,
        }


@dataclass
class _Timing:
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
            "steps_per_s": _finite(self.steps / busy),
            "episodes_per_s": _finite(self.episodes / busy),
            **self.extra,
        }


class _BareLoopFailed(Exception):
    """The agent or env raised in the bare loop; ``detail`` is the traceback."""

    def __init__(self, message: str, detail: str) -> None:
        super().__init__(message)
        self.detail = detail


def _bench(args: argparse.Namespace) -> dict[str, Any]:
    from .._plan._arguments import chronic_names

    rss_start = _rss("VmRSS")
    agent = load_agent(args.agent)
    env = make_env(args.env, test=args.test, backend=args.backend)
    try:
        names = chronic_names(env)
        env_seeds, agent_seeds = derive_seeds(args.seed, args.episodes)
        assert env_seeds is not None and agent_seeds is not None
        plan = _Plan(
            nb_episode=args.episodes,
            workers=args.workers,
            max_iter=args.max_iter,
            episode_ids=[i % len(names) for i in range(args.episodes)] if names else None,
            env_seeds=env_seeds,
            agent_seeds=agent_seeds,
        )
        report: dict[str, Any] = dict.fromkeys(_KEYS)
        report["version"] = JSON_VERSION
        report["config"] = _config(args, env, plan)
        errors: dict[str, str | None] = {"grid2op": None, "asyncrunner": None}
        report["errors"] = errors
        _progress(f"bare loop: {plan.nb_episode} episodes in this process")
        try:
            bare, bare_results = _bare_loop(env, agent, plan)
        except Exception as exc:
            raise _BareLoopFailed(
                _first_line(f"{type(exc).__name__}: {exc}"), traceback.format_exc()
            ) from None
        report["bare_loop"] = bare.as_dict()
        g2op: _Timing | None = None
        g2op_results: list[tuple[str, int, float]] | None = None
        if not args.skip_grid2op:
            _progress(f"grid2op's Runner, nb_process={plan.workers}")
            try:
                g2op, g2op_results = _grid2op(env, agent, plan)
            except Exception as exc:
                errors["grid2op"] = _first_line(f"{type(exc).__name__}: {exc}")
        report["grid2op"] = None if g2op is None else g2op.as_dict()
        rss_before = _rss("VmRSS")
        hwm_reset = _reset_peak_rss()
        ours: dict[str, Any] = {}
        our_results: dict[str, list[tuple[str, int, float]]] = {}
        probe: dict[str, Any] = {
            "enabled": args.lag_probe,
            "tick_ms": _TICK * 1000,
            "cpu_us_per_wakeup": None,
        }
        report["lag_probe"] = probe
        try:
            anyio.run(
                _asyncrunner_runs, env, agent, plan, ours, our_results, probe, backend=args.loop
            )
        except Exception as exc:
            leaf = _leaf(exc)
            errors["asyncrunner"] = _first_line(f"{type(leaf).__name__}: {leaf}")
        rss_after = _rss("VmRSS")
        report["asyncrunner"] = {
            key: ours.get(key) for key in ("cold", "warm", "warm_no_sinks", "warm_all_sinks")
        }
    finally:
        env.close()
    report["ratios"] = _ratios(report, plan.workers)
    report["streaming_cost"] = _streaming_cost(report)
    report["agreement"] = _agreement(bare_results, g2op_results, our_results)
    report["memory"] = {
        "ru_maxrss_mb": _ru_maxrss_mb(),
        "rss_start_mb": rss_start,
        "rss_before_asyncrunner_mb": rss_before,
        "rss_after_asyncrunner_mb": rss_after,
        "peak_during_asyncrunner_mb": _rss("VmHWM") if hwm_reset else None,
    }
    return report


def _config(args: argparse.Namespace, env: Any, plan: _Plan) -> dict[str, Any]:
    return {
        "env": args.env,
        "test": bool(args.test if args.test is not None else args.env == DEFAULT_ENV),
        "backend": _backend_name(env.backend),
        "agent": args.agent,
        "episodes": plan.nb_episode,
        "workers": plan.workers,
        "max_iter": plan.max_iter,
        "seed": args.seed,
        "loop": args.loop,
        "episode_ids": plan.episode_ids,
        "env_seeds": plan.env_seeds,
        "agent_seeds": plan.agent_seeds,
        "cpu_count": os.cpu_count(),
        "versions": {
            "python": platform.python_version(),
            **{
                name: _version(name)
                for name in ("grid2op", "lightsim2grid", "anyio", "asyncrunner")
            },
        },
    }


def _backend_name(backend: Any) -> str:
    # grid2op renames the backend's class per env ("LightSimBackend_<env name>...").
    cls = type(backend)
    for base in cls.__mro__[1:]:
        if cls.__name__.startswith(base.__name__ + "_"):
            return base.__name__
    return cls.__name__


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _new_agent(agent: Any, action_space: Any) -> Any:
    from grid2op.Agent import BaseAgent

    if isinstance(agent, BaseAgent):
        return copy.copy(agent)
    return agent(action_space)  # a class, or a factory (action_space) -> agent


def _bare_loop(env: Any, agent: Any, plan: _Plan) -> tuple[_Timing, list[tuple[str, int, float]]]:
    """Every episode in turn in this process, on a copy of the env: reset, then act/step."""
    env = env.copy()  # the user's env stays as it was, for the recipes of the others
    try:
        if plan.max_iter is not None:
            env.set_max_iter(plan.max_iter)
        results = []
        elapsed = 0.0
        for i in range(plan.nb_episode):
            options = {} if plan.episode_ids is None else {"time serie id": plan.episode_ids[i]}
            player = _new_agent(agent, env.action_space)
            start = time.perf_counter()
            obs = env.reset(seed=plan.env_seeds[i], options=options)
            player.seed(plan.agent_seeds[i])
            player.reset(obs)
            reward, done, steps, cum_reward = float(env.reward_range[0]), False, 0, 0.0
            while not done:
                obs, reward, done, _info = env.step(player.act(obs, reward, done))
                steps += 1
                cum_reward += reward
            elapsed += time.perf_counter() - start
            results.append((str(env.chronics_handler.get_name()), steps, float(cum_reward)))
        timing = _Timing(elapsed, plan.nb_episode, sum(r[1] for r in results))
        return timing, results
    finally:
        env.close()


def _grid2op(env: Any, agent: Any, plan: _Plan) -> tuple[_Timing, list[tuple[str, int, float]]]:
    from grid2op.Agent import BaseAgent
    from grid2op.Runner import Runner

    if isinstance(agent, type):
        chosen = {"agentClass": agent}
    elif isinstance(agent, BaseAgent):
        chosen = {"agentInstance": agent}
    else:  # a factory: grid2op takes an instance
        chosen = {"agentInstance": agent(env.action_space)}
    with tempfile.TemporaryDirectory(prefix="asyncrunner-bench-grid2op-") as path_save:
        start = time.perf_counter()
        runner = Runner(**env.get_params_for_runner(), **chosen)
        rows = runner.run(
            plan.nb_episode, nb_process=plan.workers, path_save=path_save, **plan.kwargs()
        )
        elapsed = time.perf_counter() - start
    # (chronics_path, name, cum_reward, nb_time_step, max_ts)
    results = [(str(row[1]), int(row[3]), float(row[2])) for row in rows]
    timing = _Timing(elapsed, len(rows), sum(r[1] for r in results), {"nb_process": plan.workers})
    return timing, results


# --- AsyncRunner --------------------------------------------------------------------------------


class _LagProbe:
    """Sleeps ``_TICK`` over and over and records how late each wake-up is (in seconds)."""

    def __init__(self) -> None:
        self.samples: list[float] | None = None

    async def tick(self) -> None:
        while True:
            start = time.perf_counter()
            await anyio.sleep(_TICK)
            late = time.perf_counter() - start - _TICK
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


async def _asyncrunner_runs(
    env: Any,
    agent: Any,
    plan: _Plan,
    out: dict[str, Any],
    results: dict[str, list[tuple[str, int, float]]],
    probe_info: dict[str, Any],
) -> None:
    from .._runner import AsyncRunner
    from ..sinks import CallbackSink

    probe = _LagProbe()

    async def runs(lag_pass: bool, tmp: str) -> None:
        """The AsyncRunner runs, timed into ``out`` or (``lag_pass``) measuring the loop's lag."""

        async def measured(
            name: str,
            start: float,
            run: Callable[..., Any],
            *,
            path_save: str | None,
            sinks: Sequence[Any] | None = (),
        ) -> None:
            # sinks=None: no sink at all; else a first-step clock plus ``sinks``.
            if not lag_pass:
                _progress(f"AsyncRunner: {name.replace('_', ' ')}")
            clock = _FirstSteps(start)
            attached = [] if sinks is None else [CallbackSink(clock), *sinks]
            probe.begin()
            cpu = time.process_time()
            played = await run(
                plan.nb_episode, path_save=path_save, sinks=attached, **plan.kwargs()
            )
            elapsed = time.perf_counter() - start
            cpu = time.process_time() - cpu
            lag = probe.end()
            if lag_pass:
                out[name]["loop_lag_ms"] = lag
                return
            results[name] = rows = _summary(played)
            steps = sum(r[1] for r in rows)
            extra: dict[str, Any] = {
                **(clock.as_dict() if attached else dict.fromkeys(clock.as_dict())),
                "parent_cpu_s": cpu,
                "parent_cpu_us_per_step": cpu / steps * 1e6 if steps else None,
            }
            out[name] = {**_Timing(elapsed, len(rows), steps, extra).as_dict(), "loop_lag_ms": None}

        if lag_pass:
            _progress("AsyncRunner: the same runs again, with the 1 ms ticker beside them")
        start = time.perf_counter()
        async with AsyncRunner(env, agent=agent, workers=plan.workers) as runner:
            await measured("cold", start, runner.run, path_save=os.path.join(tmp, "cold"))
            await measured(
                "warm", time.perf_counter(), runner.run, path_save=os.path.join(tmp, "warm")
            )
            await measured(
                "warm_no_sinks", time.perf_counter(), runner.run, path_save=None, sinks=None
            )
            every, names = _every_sink(tmp)
            await measured(
                "warm_all_sinks",
                time.perf_counter(),
                runner.run,
                path_save=os.path.join(tmp, "all"),
                sinks=every,
            )
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


# --- figures -----------------------------------------------------------------------------------


def _steps_per_s(part: dict[str, Any] | None) -> float | None:
    return None if part is None else part.get("steps_per_s")


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or not b:
        return None
    return _finite(a / b)


def _ratios(report: dict[str, Any], workers: int) -> dict[str, float | None]:
    ours = report["asyncrunner"]
    bare = _steps_per_s(report["bare_loop"])
    limit = None if bare is None else workers * bare
    g2op = _steps_per_s(report["grid2op"])
    cold, warm = _steps_per_s(ours["cold"]), _steps_per_s(ours["warm"])
    return {
        "cold_vs_grid2op": _ratio(cold, g2op),
        "warm_vs_grid2op": _ratio(warm, g2op),
        "cold_vs_bare": _ratio(cold, limit),
        "warm_vs_bare": _ratio(warm, limit),
        "all_sinks_vs_no_sinks": _ratio(
            _steps_per_s(ours["warm_all_sinks"]), _steps_per_s(ours["warm_no_sinks"])
        ),
    }


def _streaming_cost(report: dict[str, Any]) -> dict[str, Any]:
    ours = report["asyncrunner"]
    ratio = report["ratios"]["all_sinks_vs_no_sinks"]
    every = ours["warm_all_sinks"]
    return {
        "sinks": None if every is None else every["sinks"],
        "no_sinks_steps_per_s": _steps_per_s(ours["warm_no_sinks"]),
        "all_sinks_steps_per_s": _steps_per_s(every),
        "ratio": ratio,
        "slowdown_percent": None if ratio is None else 100.0 * (1.0 - ratio),
    }


def _agreement(
    bare: list[tuple[str, int, float]],
    g2op: list[tuple[str, int, float]] | None,
    ours: dict[str, list[tuple[str, int, float]]],
) -> dict[str, Any]:
    totals = {name: sum(r[1] for r in rows) for name, rows in ours.items()}
    our_steps = next(iter(totals.values()), None)
    g2op_steps = None if g2op is None else sum(r[1] for r in g2op)
    bare_steps = sum(r[1] for r in bare)
    if not ours:
        steps_agree = results_agree = None
        detail = "no AsyncRunner run finished: nothing to compare"
    elif len(set(totals.values())) > 1:
        steps_agree = results_agree = False
        listed = ", ".join(f"{name} {steps}" for name, steps in totals.items())
        detail = f"the AsyncRunner runs played different totals of steps: {listed}"
    elif g2op is None:
        steps_agree = results_agree = None
        same = all(sorted(rows) == sorted(next(iter(ours.values()))) for rows in ours.values())
        detail = f"grid2op's Runner not run; the AsyncRunner runs each played {our_steps} steps" + (
            "" if same else " (with different rewards per episode)"
        )
    else:
        steps_agree = our_steps == g2op_steps
        results_agree = steps_agree and all(sorted(rows) == sorted(g2op) for rows in ours.values())
        if results_agree:
            detail = (
                f"AsyncRunner and grid2op's Runner agree: {our_steps} steps in total, the same "
                "steps and reward for each episode"
            )
        elif steps_agree:
            detail = (
                f"AsyncRunner and grid2op's Runner played the same {our_steps} steps in total but "
                "their per-episode rewards or steps DIFFER"
            )
        else:
            detail = (
                f"AsyncRunner and grid2op's Runner DISAGREE: {our_steps} steps vs {g2op_steps}: "
                "the comparison is not of equal work"
            )
    if bare_steps != our_steps and our_steps is not None:
        detail += f" (the bare loop played {bare_steps})"
    return {
        "steps_agree": steps_agree,
        "results_agree": results_agree,
        "asyncrunner_steps": our_steps,
        "grid2op_steps": g2op_steps,
        "bare_loop_steps": bare_steps,
        "detail": detail,
    }


def _finite(value: float) -> float | None:
    return value if value == value and value not in (float("inf"), float("-inf")) else None


def _first_line(text: str, limit: int = 300) -> str:
    """The first line of ``text`` (an error's message, not the traceback it may carry)."""
    lines = text.strip().splitlines()
    line = lines[0].strip() if lines else ""
    return line if len(line) <= limit else line[: limit - 1] + "…"


def _leaf(exc: BaseException) -> BaseException:
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


# --- memory ------------------------------------------------------------------------------------


def _rss(field_name: str) -> float | None:
    """``VmRSS`` / ``VmHWM`` of this process in MiB, from ``/proc/self/status`` (Linux)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1]) * 1024 / _MB
    except (OSError, ValueError, IndexError):
        pass
    return None


def _reset_peak_rss() -> bool:
    """Reset ``VmHWM`` to the current RSS (Linux ``clear_refs`` 5); whether it worked."""
    try:
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")
        return True
    except OSError:
        return False


def _ru_maxrss_mb() -> float | None:
    try:
        import resource
    except ImportError:  # Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / _MB if sys.platform == "darwin" else peak * 1024 / _MB  # bytes vs KiB


# --- text report -------------------------------------------------------------------------------


def _num(value: float | None, spec: str = ",.0f", unit: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{unit}"


def _print_report(report: dict[str, Any]) -> None:
    cfg, ours = report["config"], report["asyncrunner"]
    n = cfg["workers"]
    max_iter = "env default" if cfg["max_iter"] is None else cfg["max_iter"]
    versions = ", ".join(f"{k} {v}" for k, v in cfg["versions"].items() if v is not None)
    print(
        f"asyncrunner bench: {cfg['env']}{' (test)' if cfg['test'] else ''} on {cfg['backend']}, "
        f"{cfg['agent']}, {cfg['episodes']} episodes, N={n}, max_iter={max_iter}, "
        f"seed {cfg['seed']}, {cfg['loop']}"
    )
    print(f"{versions}; {cfg['cpu_count']} CPUs")
    print()
    rows = [
        ("bare loop (1 process, no saving)", report["bare_loop"]),
        (f"grid2op Runner (nb_process={n}, path_save)", report["grid2op"]),
        (f"AsyncRunner cold (workers={n}, path_save)", ours["cold"]),
        ("AsyncRunner warm (path_save)", ours["warm"]),
        ("AsyncRunner warm, no sink", ours["warm_no_sinks"]),
        ("AsyncRunner warm, every sink", ours["warm_all_sinks"]),
    ]
    width = max(len(label) for label, _ in rows)
    print(f"{'':{width}}  {'seconds':>8}  {'steps':>7}  {'steps/s':>8}  {'episodes/s':>10}")
    for label, part in rows:
        if part is None:
            missing = (
                "skipped" if "grid2op" in label and not report["errors"]["grid2op"] else "failed"
            )
            print(f"{label:{width}}  {missing:>8}")
            continue
        print(
            f"{label:{width}}  {part['seconds']:8.2f}  {part['steps']:7d}  "
            f"{_num(part['steps_per_s']):>8}  {_num(part['episodes_per_s'], '.2f'):>10}"
        )
    ratios = report["ratios"]
    print()
    print(f"{'ratio (steps/s, = episodes/s)':{width}}  {'cold':>8}  {'warm':>7}")
    for label, key in (
        ("AsyncRunner / grid2op Runner", "grid2op"),
        (f"AsyncRunner / ({n} × bare loop)", "bare"),
    ):
        cold, warm = ratios[f"cold_vs_{key}"], ratios[f"warm_vs_{key}"]
        print(f"{label:{width}}  {_num(cold, '.2f', '×'):>8}  {_num(warm, '.2f', '×'):>7}")
    if any(part is not None for part in ours.values()):
        print()
        _print_runs(report, width)
    cost = report["streaming_cost"]
    if cost["ratio"] is not None:
        print(
            f"streaming cost: every sink ({', '.join(cost['sinks'])}) "
            f"{_num(cost['all_sinks_steps_per_s'])} steps/s vs no sink "
            f"{_num(cost['no_sinks_steps_per_s'])} steps/s: {cost['ratio']:.2f}× "
            f"({abs(cost['slowdown_percent']):.1f} % "
            f"{'slower' if cost['slowdown_percent'] >= 0 else 'faster: noise'})"
        )
    mem = report["memory"]
    print(
        f"parent memory: peak RSS {_num(mem['ru_maxrss_mb'])} MiB over the bench (ru_maxrss); "
        f"RSS {_num(mem['rss_before_asyncrunner_mb'])} MiB before the AsyncRunner runs, "
        f"{_num(mem['rss_after_asyncrunner_mb'])} MiB after, peak "
        f"{_num(mem['peak_during_asyncrunner_mb'])} MiB during them"
    )
    print(f"results: {report['agreement']['detail']}")


def _print_runs(report: dict[str, Any], width: int) -> None:
    cfg, ours, probe = report["config"], report["asyncrunner"], report["lag_probe"]
    n = cfg["workers"]

    header = (
        f"{'AsyncRunner run':{width}}  {'loop lag p50/p99/max (ms)':>25}  "
        f"{'first step per worker (s)':>25}  {'parent CPU/step':>15}"
    )
    print(header)
    for key, part in ours.items():
        if part is None:
            continue
        lag = part["loop_lag_ms"]
        lags = "-"
        if lag is not None:
            lags = (
                f"{_num(lag['p50'], '.2f')} / {_num(lag['p99'], '.1f')} / {_num(lag['max'], '.1f')}"
            )
        firsts = ", ".join(f"{t:.2f}" for t in part["first_step_s"] or []) or "-"
        started, expected = len(part["first_step_s"] or []), min(n, cfg["episodes"])
        if part["first_step_s"] is not None and started < expected:
            firsts += f" (only {started} of {expected} workers)"
        cpu = _num(part["parent_cpu_us_per_step"], ",.0f", " µs")
        print(f"{key.replace('_', ' '):{width}}  {lags:>25}  {firsts:>25}  {cpu:>15}")
    if probe["enabled"]:
        print(
            f"(loop lag: how late a {probe['tick_ms']:g} ms sleep wakes up beside the same runs "
            f"played again; each wake-up costs this process "
            f"{_num(probe['cpu_us_per_wakeup'], '.0f')} µs of CPU, kept out of the timed runs)"
        )
    print(
        "(first step: from the runner's construction for cold, from run() otherwise; "
        "parent CPU: event loop and sink threads)"
    )
