"""What ``asyncrunner run`` will do: its arguments checked and turned into a runner's settings,
before any worker starts."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from .._engine._parsed import parsing_once
from .._exceptions import EpisodeError
from .._model import (
    EpisodeFailed,
    EpisodeFinished,
    EpisodeResult,
    EpisodeStarted,
    Event,
    RunStarted,
)
from .._pools._dask import unreachable
from ..sinks import Sink
from ._common import DEFAULT_ENV, UsageError, as_options, derive_seeds, load_agent, make_env

__all__ = ["Settings"]


class Settings:
    """What ``run`` will do, checked and built before any worker starts."""

    def __init__(self, args: argparse.Namespace) -> None:
        from .._plan._arguments import check_path_save, chronic_names, plan_episodes
        from .._runner import AsyncRunner

        # Everything that can be checked without the env first: building it takes seconds.
        if args.resume and args.save is None:
            raise UsageError("--resume needs --save DIR: the folder of the run to resume")
        if args.scheduler is not None and args.dask_local is not None:
            raise UsageError("choose one of --scheduler and --dask-local")
        agent = load_agent(args.agent)
        if args.save is not None:
            try:
                check_path_save(args.save)
            except (ValueError, TypeError) as exc:
                raise UsageError(as_options(str(exc))) from None
        if args.scheduler is not None:
            _check_scheduler(args.scheduler)
        # (parsing_once: the grid's and first chronic's files parsed by an earlier command, or
        # the workers of one, come from the disk's cache: idf_2023's build 1.2 s -> 0.5 s)
        with parsing_once():
            self.env = make_env(args.env, test=args.test, backend=args.backend)
        names = None
        try:
            names = chronic_names(self.env)
            ids = None
            if args.episode_id is not None:
                ids = [_episode_id(i, names) for i in args.episode_id]
            nb = args.episodes
            if nb is None:
                nb = 2 if ids is None else len(ids)
            if ids is not None and len(ids) != nb:
                raise UsageError(
                    f"--episode-id gives {len(ids)} ids but --episodes is {nb}: give one id per "
                    "episode, or leave --episodes out"
                )
            env_seeds, agent_seeds = derive_seeds(args.seed, nb)
            self.nb_episode = nb
            self.kwargs: dict[str, Any] = {
                "max_iter": args.max_iter,
                "episode_id": ids,
                "env_seeds": env_seeds,
                "agent_seeds": agent_seeds,
                "on_error": args.on_error,
                "path_save": args.save,
                "resume": args.resume,
            }
            # Reject bad episode ids, seeds and counts now, with the env at hand.
            plan_episodes(
                nb,
                names=names,
                max_iter=args.max_iter,
                env_seeds=env_seeds,
                agent_seeds=agent_seeds,
                episode_id=ids,
            )
            # Progress bars by default only where someone watches them.
            watched = sys.stderr is not None and sys.stderr.isatty()  # (None: `2>&-`)
            self.kwargs["pbar"] = watched if args.pbar is None else args.pbar
            self.tracker = _Tracker()
            executor = None
            workers = args.workers
            if args.scheduler is not None or args.dask_local is not None:
                try:
                    from .._pools._dask import DaskExecutor

                    executor = DaskExecutor(args.scheduler, local_workers=args.dask_local)
                except ImportError as exc:
                    raise ValueError(str(exc)) from None
                if workers is None and args.dask_local is not None:
                    workers = args.dask_local
            # The constructor checks the agent can go to workers; it starts nothing. The env is
            # as grid2op.make returned it: forked workers start from copies of it (copy_env),
            # which play what grid2op's Runner plays, without building one.
            self.runner = AsyncRunner(
                self.env, agent=agent, workers=workers, executor=executor, copy_env=True
            )
        except (ValueError, TypeError) as exc:
            self.env.close()
            raise UsageError(as_options(str(exc)) + _swallowed_env_hint(args, names)) from None
        except BaseException:
            self.env.close()
            raise

    async def play(self) -> tuple[list[EpisodeResult], float, float]:
        """Results (under ``--on-error raise``: what finished and the failure), wall time, time
        to the first episode."""
        tracker = self.tracker
        tracker.start = time.perf_counter()
        async with self.runner as runner:
            try:
                results = await runner.run(self.nb_episode, sinks=[tracker], **self.kwargs)
            except EpisodeError as exc:
                # What finished, plus the failed episode; the rest was cancelled.
                assert exc.result is not None  # (the run's own error)
                results = sorted([*exc.results, exc.result], key=lambda r: r.index)
        end = time.perf_counter()
        first = tracker.first if tracker.first is not None else end
        return results, end - tracker.start, first - tracker.start


def _episode_id(text: str, names: list[str] | None) -> int | str:
    # A chronic's folder name wins over an index: "0001" may be either.
    if names is not None and text in names:
        return text
    try:
        value = int(text)
    except ValueError:
        return text
    if names is not None and not 0 <= value < len(names):  # ("0003": a name, or a position)
        shown = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
        raise UsageError(
            f"--episode-id {text}: the env has no chronic of that name ({shown}) and none at "
            f"that position (0 to {len(names) - 1})"
        )
    return value


def _swallowed_env_hint(args: argparse.Namespace, names: list[str] | None) -> str:
    """`run --episode-id 0000 my_env` reads my_env as an id and plays the default env."""
    if not args.episode_id:
        return ""
    last = args.episode_id[-1]
    if args.env != DEFAULT_ENV or (names is not None and last in names) or last.isdigit():
        return ""
    return (
        f" (if {last!r} is the env to play, give it before --episode-id, which takes every word "
        f"after it: asyncrunner run {last} --episode-id ...)"
    )


def _check_scheduler(address: str) -> None:
    """Fail fast when nothing listens at a TCP scheduler address (Dask would wait for minutes)."""
    reason = unreachable(address)
    if reason is not None:
        raise UsageError(
            f"--scheduler {address}: no Dask scheduler reachable there ({reason}); start one "
            "with `dask scheduler`, or use --dask-local N"
        )


class _Tracker(Sink):
    """What the run did so far: the time before the first episode is workers starting up; what
    started and finished is what an interrupted run reports."""

    needs_steps = False

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.first: float | None = None
        self.run_id: str | None = None
        self.started: dict[int, EpisodeStarted] = {}
        self.finished: dict[int, EpisodeResult] = {}
        self.failed: dict[int, EpisodeResult] = {}  # for good (not retried)

    async def send(self, event: Event) -> None:
        if isinstance(event, RunStarted):
            self.run_id = event.run_id
        elif isinstance(event, EpisodeStarted):
            if self.first is None:
                self.first = time.perf_counter()
            self.started[event.index] = event
        elif isinstance(event, EpisodeFinished):
            mix = self.started[event.index].mix if event.index in self.started else None
            self.finished[event.index] = EpisodeResult.of_finished(event, mix=mix)
        elif isinstance(event, EpisodeFailed) and not event.retrying:
            started = self.started.get(event.index)
            seeds = (None, None) if started is None else (started.env_seed, started.agent_seed)
            self.failed[event.index] = EpisodeResult.of_failed(
                event,
                started,
                env_seed=seeds[0],
                agent_seed=seeds[1],
                mix=None if started is None else started.mix,
            )
