"""The ``asyncrunner`` command line: ``asyncrunner run`` plays episodes and prints their results.

Exit status: 0 when every episode was played, 1 when one failed, 2 for bad arguments, 130 when
interrupted. Bad arguments print one line and a hint, never a traceback, before any env is built.
A failed episode's traceback goes to stderr; an interrupted run prints what finished and the
command that resumes it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import sys
import warnings
from collections.abc import Sequence
from dataclasses import replace as _replace

from .._exceptions import SinkError
from .._model import (
    EpisodeResult,
)
from .._plan._mixes import mixes_of
from ._common import (
    DEFAULT_ENV,
    QUIET,
    Parser,
    Terminated,
    UsageError,
    add_env_options,
    as_options,
    at_least,
    one_line,
    parse_max_iter,
    run_until_stopped,
    to_devnull,
)
from ._settings import Settings

__all__ = ["build_parser", "run_command"]


def build_parser() -> tuple[Parser, Parser]:
    parser = Parser(
        prog="asyncrunner",
        description="Run grid2op episodes concurrently in worker processes.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    run = commands.add_parser(
        "run",
        help="play episodes of an agent on an env and print their results",
        description=(
            "Play episodes of an agent on a grid2op env in worker processes and print one line "
            "per episode. With no arguments: DoNothingAgent on l2rpn_case14_sandbox (test data "
            "shipped with grid2op, no download)."
        ),
    )
    run.add_argument(
        "env",
        nargs="?",
        default=DEFAULT_ENV,
        help=f"grid2op env name or path to an env folder (default: {DEFAULT_ENV})",
    )
    add_env_options(run)
    run.add_argument(
        "--agent",
        default="DoNothingAgent",
        metavar="SPEC",
        help=(
            "module:Name, path/to/file.py:Name, or the name of an agent in grid2op.Agent; Name "
            "is a BaseAgent subclass or a factory (action_space) -> agent (default: DoNothingAgent)"
        ),
    )
    run.add_argument(
        "--episodes",
        "-n",
        type=at_least(0),
        default=None,
        metavar="N",
        help="how many episodes to play (default: 2, or one per --episode-id)",
    )
    run.add_argument(
        "--workers",
        "-w",
        type=at_least(1),
        default=None,
        metavar="N",
        help=(
            "episodes played at once, one worker process each "
            "(default: the CPUs this process may use)"
        ),
    )
    run.add_argument(
        "--scheduler",
        default=None,
        metavar="ADDRESS",
        help=(
            "play the episodes on a Dask cluster, e.g. tcp://HOST:8786 (needs asyncrunner[dask]; "
            "its workers need asyncrunner and the agent's code installed)"
        ),
    )
    run.add_argument(
        "--dask-local",
        type=at_least(1),
        default=None,
        metavar="N",
        help="play the episodes on a Dask LocalCluster of N single-threaded worker processes",
    )
    run.add_argument(
        "--seed",
        type=at_least(0),
        default=None,
        help="derive every episode's env and agent seeds from this one (reproducible runs)",
    )
    run.add_argument(
        "--max-iter",
        type=parse_max_iter,
        default=None,
        metavar="N",
        help="stop each episode after N steps (-1: no limit; default: the env's own)",
    )
    run.add_argument(
        "--episode-id",
        action="extend",
        nargs="+",
        default=None,
        metavar="ID",
        help="chronic to play, by index or folder name, one per episode (repeatable)",
    )
    run.add_argument(
        "--save",
        default=None,
        type=os.path.expanduser,  # --save=~/runs: the shell leaves "~" as it is
        metavar="DIR",
        help="save each episode in grid2op's EpisodeData format under DIR (default: save nothing)",
    )
    run.add_argument(
        "--resume",
        action="store_true",
        help=(
            "with --save: skip the episodes already saved complete in DIR (same chronic, seeds "
            "and --max-iter) and play only the missing ones"
        ),
    )
    run.add_argument(
        "--on-error",
        choices=("raise", "continue"),
        default="raise",
        help=(
            "raise: stop at the first failed episode (default); continue: play every episode "
            "and report failures in the table (tracebacks on stderr)"
        ),
    )
    run.add_argument(
        "--pbar",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="show a progress bar on stderr (default: when stderr is a terminal)",
    )
    commands.add_parser(
        "show",
        add_help=False,
        help="summarise a saved run (EpisodeData folders), optionally --plot FILE.png",
    )
    commands.add_parser(
        "score",
        add_help=False,
        help="score agents as grid2op's competition classes do, side by side",
    )
    commands.add_parser(
        "bench",
        add_help=False,
        help="compare with grid2op's Runner on your env and agent",
    )
    return parser, run


# --- run ---------------------------------------------------------------------------------------


def run_command(args: argparse.Namespace, parser: Parser, argv: list[str]) -> int:
    for message in QUIET:
        warnings.filterwarnings("ignore", message=message)
    try:
        settings = Settings(args)
    except UsageError as exc:
        parser.error(str(exc))
    try:
        if args.save is not None and not args.resume:
            from ._show import note_earlier_episodes

            note_earlier_episodes(args.save, "run")
        try:
            results, elapsed, startup = run_until_stopped(settings.play())
        finally:
            settings.env.close()
    except ValueError as exc:  # refused before any episode (another env's episodes in --save)
        parser.error(as_options(str(exc)))
    except KeyboardInterrupt as exc:
        terminated = exc if isinstance(exc, Terminated) else None
        with contextlib.suppress(OSError):  # a terminal hung up: nothing can be written
            _report_stopped(settings, args, argv, terminated.why if terminated else "interrupted")
        return terminated.status if terminated else 130
    except SinkError as exc:  # saving (a full disk...) or the progress bar failed: it stopped
        cause = exc.__cause__
        what = f"{type(cause).__name__}: {cause}" if cause is not None else str(exc)
        notes = "".join(f" ({note})" for note in getattr(exc, "__notes__", ()))
        why = f"stopped: {type(exc.sink).__name__} failed: {what}{notes}"
        _report_stopped(settings, args, argv, why)
        return 1
    _print_table(results, seeded=args.seed is not None)
    failed = [r for r in results if r.error is not None]
    # With --resume, what was read back from disk rather than played.
    saved = [r for r in results if r.error is None and r.index not in settings.tracker.started]
    steps = sum(r.nb_time_step for r in results if r not in saved)
    played = len(results) - len(failed) - len(saved)
    # A multimix env plays the episodes on each of its mixes.
    requested = settings.nb_episode * len(mixes_of(settings.env) or [None])
    # Under --on-error raise, the episodes still to play when one failed are not played.
    cancelled = requested - len(results)
    busy = elapsed - startup
    rate = f", {steps / busy:.0f} steps/s after {startup:.1f} s of startup" if busy > 0 else ""
    earlier = f", {len(saved)} already saved in {args.save}" if args.resume else ""
    stopped = f", {cancelled} cancelled" if cancelled > 0 else ""
    # Where, in full: a relative --save is the current folder's (and --save=~/x the home's).
    where = f"; saved in {os.path.abspath(args.save)}" if args.save is not None else ""
    print(
        f"{played}/{requested} episodes played{earlier}, {len(failed)} failed{stopped}, "
        f"{steps} steps in {elapsed:.1f} s{rate}{where}"
    )
    _print_failures(failed)
    if args.save is not None and (failed or cancelled > 0):
        kept = sum(r.error is None and r.path is not None for r in results)
        resume = argv if args.resume else [*argv, "--resume"]
        left = len(failed) + max(cancelled, 0)
        print(
            f"asyncrunner: {kept} saved in {args.save}; once fixed, play the other "
            f"{left} with: asyncrunner {shlex.join(resume)}",
            file=sys.stderr,
        )
    return 1 if failed else 0


def _print_failures(failed: Sequence[EpisodeResult]) -> None:
    for r in failed:
        assert r.error is not None
        # The episode's own traceback (the agent's or env's code): what the user needs to fix.
        error = r.error
        where = f" ({r.mix + '/' if r.mix else ''}{r.name})" if r.name else ""
        print(
            f"asyncrunner: episode {r.index}{where} failed after {error.step} steps: "
            f"{error.error_type}: {error.message}",
            file=sys.stderr,
        )
        if error.traceback:
            print(error.traceback.rstrip(), file=sys.stderr)


def _report_stopped(
    settings: Settings, args: argparse.Namespace, argv: list[str], why: str
) -> None:
    """After Ctrl-C or a failed sink: what finished, where it is saved, and the command that
    plays the rest."""
    tracker = settings.tracker
    done = [tracker.finished[i] for i in sorted(tracker.finished)]
    failed = [tracker.failed[i] for i in sorted(tracker.failed) if i not in tracker.finished]
    mixes = list(mixes_of(settings.env) or {})  # a multimix env saves in DIR/<mix>
    if args.save is not None:
        from .._plan._layout import damage, saved_episodes

        # What is really on disk: an episode that finished as the run was cancelled may not be.
        folders = [args.save, *(os.path.join(args.save, mix) for mix in mixes)]
        on_disk = {
            record.get("index"): folder
            for root in folders
            if os.path.isdir(root)
            for folder, record in saved_episodes(root)
            if record.get("run_id") == tracker.run_id and damage(folder, record) is None
        }
        done = [_replace(r, path=on_disk.get(r.index)) for r in done]
    if done or failed:
        try:
            _print_table(
                sorted([*done, *failed], key=lambda r: r.index), seeded=args.seed is not None
            )
            sys.stdout.flush()
        except BrokenPipeError:  # its reader left (`| tee`, stopped by the same Ctrl-C)
            to_devnull(sys.stdout)  # what follows is on stderr
    requested = settings.nb_episode * len(mixes or [None])
    print(
        f"asyncrunner: {why}; {len(done)}/{requested} episodes finished"
        + (f", {len(failed)} failed" if failed else "")
        + (
            " in this run (those saved before are kept: --resume skips them)" if args.resume else ""
        ),
        file=sys.stderr,
    )
    _print_failures(failed)
    if args.save is None:
        print(
            "asyncrunner: nothing was saved; run with --save DIR to keep finished episodes and "
            "resume later",
            file=sys.stderr,
        )
        return
    saved = [os.path.relpath(r.path, args.save) for r in done if r.path is not None]
    print(
        f"asyncrunner: {len(saved)} saved in {args.save}"
        + (" by this run" if args.resume else "")
        + (f": {', '.join(saved)}" if saved else ""),
        file=sys.stderr,
    )
    resume = argv if args.resume else [*argv, "--resume"]
    print(f"asyncrunner: resume with: asyncrunner {shlex.join(resume)}", file=sys.stderr)


def _print_table(results: Sequence[EpisodeResult], *, seeded: bool) -> None:
    mixed = any(r.mix is not None for r in results)  # a multimix env: say which mix
    header = ["index", *(["mix"] if mixed else []), "chronic", "steps/max", "cum reward"]
    if seeded:
        header += ["env seed", "agent seed"]
    header.append("error")
    rows = []
    for r in results:
        steps = f"{r.nb_time_step}/{r.max_ts if r.max_ts else '?'}"
        mix = [r.mix or "-"] if mixed else []
        row = [str(r.index), *mix, r.name or "-", steps, f"{r.cum_reward:.2f}"]
        if seeded:
            row += [str(r.env_seed), str(r.agent_seed)]
        error = r.error
        row.append("" if error is None else one_line(f"{error.error_type}: {error.message}"))
        rows.append(row)
    widths = [max([len(h), *(len(row[i]) for row in rows)]) for i, h in enumerate(header)]
    numbers = {"index", "steps/max", "cum reward", "env seed", "agent seed"}
    right = {i for i, h in enumerate(header) if h in numbers}
    for row in [header, *rows]:
        cells = [
            cell.rjust(widths[i]) if i in right else cell.ljust(widths[i])
            for i, cell in enumerate(row)
        ]
        print("  ".join(cells).rstrip())
