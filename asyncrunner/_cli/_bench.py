"""``asyncrunner bench``: AsyncRunner side by side with grid2op's Runner, on your env and agent.

One invocation plays the same episodes (same chronics, env seeds and agent seeds, same
``max_iter``) with each contender, one after the other:

1. the bare loop: ``env.reset`` then ``agent.act`` / ``env.step`` in this process, each episode on
   a fresh copy of the env (as the runners play them), nothing saved (timed from each reset to
   the episode's end): what one worker can do at most;
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

``--json`` prints one JSON object instead of the table (its layout: ``_bench_report``).

Exit status: 0, 1 when a contender failed or the contenders' results disagree, 2 for bad
arguments. Benchmark numbers are noisy on a busy machine: compare ratios from one invocation.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.metadata
import json
import os
import platform
import signal
import sys
import traceback
import warnings
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import anyio

from ._bench_contenders import (
    TICK,
    BareLoopFailed,
    Plan,
    Timing,
    asyncrunner_runs,
    bare_loop,
    bare_loops_at_once,
    grid2op_runner,
    progress,
)
from ._bench_plot import figure
from ._bench_report import (
    JSON_VERSION,
    KEYS,
    agreement,
    first_line,
    print_report,
    projection,
    ratios,
    streaming_cost,
    sweep,
    unwrap_single,
)
from ._common import (
    DEFAULT_ENV,
    QUIET,
    Parser,
    Terminated,
    UsageError,
    add_env_options,
    at_least,
    check_plot,
    derive_seeds,
    kept_handlers,
    load_agent,
    make_env,
    parse_max_iter,
    stopping,
)

__all__ = ["main"]

_MB = 1024 * 1024


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
    add_env_options(parser)
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
        type=_worker_counts,
        default=[2],
        metavar="N[,N...]",
        help=(
            "AsyncRunner workers and grid2op nb_process (default: 2); a list such as 1,2,4 is a "
            "sweep: the whole bench at the largest, grid2op's Runner and AsyncRunner cold and "
            "warm at each, in a table"
        ),
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
        "--repeat",
        type=at_least(1),
        default=3,
        metavar="N",
        help=(
            "play each warm AsyncRunner run N times, in turns, and report the run of median "
            "time (default: 3; runs of a few seconds vary by 10 to 20 %% on a busy machine)"
        ),
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
        "--copy-env",
        action="store_true",
        help=(
            "AsyncRunner(copy_env=True): forked workers start from a copy of the env instead of "
            "building one (the cold run's first steps come sooner)"
        ),
    )
    parser.add_argument(
        "--skip-grid2op", action="store_true", help="do not run grid2op's Runner (quicker)"
    )
    parser.add_argument(
        "--json", action="store_true", help="print one JSON object (keys: see the module doc)"
    )
    parser.add_argument(
        "--plot",
        default=None,
        type=os.path.expanduser,  # --plot=~/bench.png: the shell leaves "~" as it is
        metavar="FILE.png",
        help="also draw each configuration's steps/s against the limit (and the sweep)",
    )
    return parser


def _worker_counts(text: str) -> list[int]:
    counts = [at_least(1)(part.strip()) for part in text.split(",")]
    if len(set(counts)) != len(counts):
        raise argparse.ArgumentTypeError(f"each worker count once, got {text!r}")
    return sorted(counts)


def main(argv: Sequence[str] | None = None) -> int:
    """``asyncrunner bench [options]``; returns the exit status."""
    from .._runner import check_local_workers

    parser = build_parser()
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.plot is not None:
        check_plot(parser, Path(args.plot))
    try:  # before anything forks (it ran grid2op's Runner with nb_process=1000 first)
        check_local_workers(args.workers[-1])
    except ValueError as exc:
        parser.error(f"--workers: {exc}")
    if args.episodes < args.workers[-1]:
        # Workers with no episode: the limit (N loops) and the rate per worker counted them.
        parser.error(
            f"--episodes {args.episodes} leaves workers idle with --workers "
            f"{args.workers[-1]}: give --episodes {args.workers[-1]} or more (the figures "
            f"compare N workers with N bare loops), or fewer workers"
        )
    with warnings.catch_warnings():
        for message in QUIET:
            warnings.filterwarnings("ignore", message=message)
        try:
            with _terminated_as_interrupted():
                report = _bench(args)
        except UsageError as exc:
            parser.error(str(exc))
        except BareLoopFailed as exc:
            print(exc.detail, file=sys.stderr, end="")
            print(
                f"asyncrunner bench: the bare loop failed, nothing to compare: {exc}",
                file=sys.stderr,
            )
            return 1
        except KeyboardInterrupt as exc:
            terminated = exc if isinstance(exc, Terminated) else None
            with contextlib.suppress(OSError):  # a terminal hung up: nothing can be written
                why = terminated.why if terminated else "interrupted"
                print(f"asyncrunner bench: {why}", file=sys.stderr)
            return terminated.status if terminated else 130
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_report(report)
    if args.plot is not None:
        figure(report).savefig(args.plot)
        print(f"plot written to {args.plot}", file=sys.stderr if args.json else sys.stdout)
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


@contextlib.contextmanager
def _terminated_as_interrupted() -> Iterator[None]:
    """SIGTERM (``timeout``, a batch system) or SIGHUP stops the bench as Ctrl-C does:
    ``Terminated`` is raised (in the AsyncRunner runs, ``_until_terminated`` cancels them
    first), the runners stop their workers and remove their temporary folders. It ended the
    process at once, leaving them. (A process forked meanwhile, a pool's, has the default.)"""
    with stopping(_terminate):
        yield


def _terminate(signum: int, frame: object) -> None:
    raise Terminated(signum)


def _default_in_child() -> None:
    """A process forked while the bench has its handler (grid2op's Runner's pool, the bare
    loops) takes the default back at once. With the handler, SIGTERM (``Pool.terminate()``)
    could leave it alive: a Python handler runs only when the main thread next runs Python,
    and a pool worker's, waiting on its queue's lock, never woke (a signal that came as it
    went to wait, or that the kernel gave its OpenBLAS thread): the bench waited in
    ``Pool.join`` for ever."""
    for signum in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(signum) is _terminate:
            signal.signal(signum, signal.SIG_DFL)


os.register_at_fork(after_in_child=_default_in_child)


async def _until_terminated(runs: Callable[[], Awaitable[None]]) -> None:
    """``await runs()``, cancelled by SIGTERM or SIGHUP as Ctrl-C cancels it, then
    ``Terminated``: raised from the signal's handler inside the event loop, it left the runners'
    sinks failing."""
    got: list[int] = []
    # (kept: asyncio's receiver leaves SIG_DFL, and the bench's next phases would end at once)
    with kept_handlers() as signums:
        try:
            async with anyio.create_task_group() as group:
                with anyio.open_signal_receiver(*signums) as signals:

                    async def watch() -> None:
                        async for signum in signals:
                            got.append(signum)
                            group.cancel_scope.cancel()

                    group.start_soon(watch)
                    await runs()
                    group.cancel_scope.cancel()
        except BaseExceptionGroup as exc:
            # trio raises Ctrl-C's KeyboardInterrupt in a task: it came out in a group, a
            # traceback and exit status 1 where asyncio's says "interrupted", 130
            interrupts, others = exc.split(KeyboardInterrupt)
            if interrupts is None or others is not None:
                raise
            first: BaseException = interrupts
            while isinstance(first, BaseExceptionGroup):
                first = first.exceptions[0]
            raise first from None  # (SIGTERM's Terminated stays so: 143)
    if got:
        raise Terminated(got[0])


def _bench(args: argparse.Namespace) -> dict[str, Any]:
    from .._plan._arguments import chronic_names

    rss_start = _rss("VmRSS")
    agent = load_agent(args.agent)
    env = make_env(args.env, test=args.test, backend=args.backend)
    try:
        names = chronic_names(env)
        env_seeds, agent_seeds = derive_seeds(args.seed, args.episodes)
        assert env_seeds is not None and agent_seeds is not None
        plan = Plan(
            nb_episode=args.episodes,
            workers=args.workers[-1],  # the whole bench at the largest count
            max_iter=args.max_iter,
            episode_ids=[i % len(names) for i in range(args.episodes)] if names else None,
            env_seeds=env_seeds,
            agent_seeds=agent_seeds,
            copy_env=args.copy_env,
            repeat=args.repeat,
        )
        report: dict[str, Any] = dict.fromkeys(KEYS)
        report["version"] = JSON_VERSION
        report["config"] = _config(args, env, plan)
        errors: dict[str, str | None] = {"grid2op": None, "asyncrunner": None}
        report["errors"] = errors
        progress(f"bare loop: {plan.nb_episode} episodes in this process")
        try:
            bare, bare_results = bare_loop(env, agent, plan)
        except Exception as exc:
            raise BareLoopFailed(
                first_line(f"{type(exc).__name__}: {exc}"), traceback.format_exc()
            ) from None
        report["bare_loop"] = bare.as_dict()
        progress(f"bare loop: {plan.workers} of them at once, in forked processes")
        report["bare_loops_at_once"] = bare_loops_at_once(env, agent, plan)
        g2op: Timing | None = None
        g2op_results: list[tuple[str, int, float]] | None = None
        if not args.skip_grid2op:
            progress(f"grid2op's Runner, nb_process={plan.workers}")
            try:
                g2op, g2op_results = grid2op_runner(env, agent, plan)
            except Exception as exc:
                errors["grid2op"] = first_line(f"{type(exc).__name__}: {exc}")
        report["grid2op"] = None if g2op is None else g2op.as_dict()
        rss_before = _rss("VmRSS")
        hwm_reset = _reset_peak_rss()
        ours: dict[str, Any] = {}
        our_results: dict[str, list[tuple[str, int, float]]] = {}
        probe: dict[str, Any] = {
            "enabled": args.lag_probe,
            "tick_ms": TICK * 1000,
            "cpu_us_per_wakeup": None,
        }
        report["lag_probe"] = probe
        try:
            anyio.run(
                _until_terminated,
                functools.partial(asyncrunner_runs, env, agent, plan, ours, our_results, probe),
                backend=args.loop,
            )
        except Exception as exc:
            leaf = unwrap_single(exc)
            errors["asyncrunner"] = first_line(f"{type(leaf).__name__}: {leaf}")
        rss_after = _rss("VmRSS")
        report["asyncrunner"] = {
            key: ours.get(key) for key in ("cold", "warm", "warm_no_sinks", "warm_all_sinks")
        }
        swept = {plan.workers: (report["grid2op"], report["asyncrunner"])}
        for count in args.workers[:-1]:
            swept[count] = _sweep_point(env, agent, replace(plan, workers=count), args, errors)
    finally:
        env.close()
    report["ratios"] = ratios(report, plan.workers)
    report["projection"] = projection(report["asyncrunner"]["warm"], plan.workers)
    report["sweep"] = sweep(report["bare_loop"], dict(sorted(swept.items())))
    report["streaming_cost"] = streaming_cost(report)
    report["agreement"] = agreement(bare_results, g2op_results, our_results)
    report["memory"] = {
        "ru_maxrss_mb": _ru_maxrss_mb(),
        "rss_start_mb": rss_start,
        "rss_before_asyncrunner_mb": rss_before,
        "rss_after_asyncrunner_mb": rss_after,
        "peak_during_asyncrunner_mb": _rss("VmHWM") if hwm_reset else None,
    }
    return report


def _sweep_point(
    env: Any, agent: Any, plan: Plan, args: argparse.Namespace, errors: dict[str, str | None]
) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """grid2op's Runner and AsyncRunner (cold, warm) with ``plan.workers`` workers."""
    g2op = None
    if not args.skip_grid2op:
        progress(f"sweep: grid2op's Runner, nb_process={plan.workers}")
        try:
            g2op = grid2op_runner(env, agent, plan)[0].as_dict()
        except Exception as exc:
            errors["grid2op"] = first_line(f"{type(exc).__name__}: {exc}")
    ours: dict[str, Any] = {}
    progress(f"sweep: AsyncRunner, workers={plan.workers}")
    try:
        anyio.run(
            _until_terminated,
            functools.partial(
                asyncrunner_runs, env, agent, plan, ours, {}, {"enabled": False}, sink_runs=False
            ),
            backend=args.loop,
        )
    except Exception as exc:
        leaf = unwrap_single(exc)
        errors["asyncrunner"] = first_line(f"{type(leaf).__name__}: {leaf}")
    return g2op, ours


def _config(args: argparse.Namespace, env: Any, plan: Plan) -> dict[str, Any]:
    from .._runner import usable_cpus

    return {
        "env": args.env,
        "test": bool(args.test if args.test is not None else args.env == DEFAULT_ENV),
        "backend": _backend_name(env.backend),
        "agent": args.agent,
        "episodes": plan.nb_episode,
        "workers": plan.workers,
        "sweep_workers": args.workers,
        "max_iter": plan.max_iter,
        "seed": args.seed,
        "loop": args.loop,
        "copy_env": plan.copy_env,
        "repeat": plan.repeat,
        "episode_ids": plan.episode_ids,
        "env_seeds": plan.env_seeds,
        "agent_seeds": plan.agent_seeds,
        "cpu_count": usable_cpus(),
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
