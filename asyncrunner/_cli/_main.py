"""``main`` hands each command to its module (imported only when it runs: ``show`` and ``score``
start without grid2op); ``console``, the entry point of ``asyncrunner`` and ``python -m
asyncrunner``, runs it and ends the process."""

from __future__ import annotations

import gc
import signal
import sys
import warnings
from collections.abc import Sequence

from ._common import to_devnull

__all__ = ["console", "main"]


def console() -> int:
    """The process's entry point (``asyncrunner``, ``python -m asyncrunner``): ``main()``, then
    the process ends. A Ctrl-C from here changes nothing (after a stop, the README's "a second one
    changes nothing": it raised ``KeyboardInterrupt`` in Python's exit, status -2 for 130), and
    Python's exit does not collect the objects left (the env's, pandas': it took 0.8-1.2 s after
    the last line of every command, 0.07-0.2 s without)."""
    try:
        return main()
    finally:  # (also after a usage error's SystemExit)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        gc.freeze()


def main(argv: Sequence[str] | None = None) -> int:
    """The command line ``argv`` (the process's arguments by default); returns the exit status."""
    formatwarning = warnings.formatwarning
    warnings.formatwarning = _one_line  # a command's user reads no source lines
    try:
        return _main(argv)
    finally:
        warnings.formatwarning = formatwarning


def _one_line(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    line: str | None = None,
) -> str:
    return f"asyncrunner: {category.__name__}: {message}\n"


def _main(argv: Sequence[str] | None) -> int:
    try:
        status = _command(argv)
        try:
            for stream in (sys.stdout, sys.stderr):  # what is still buffered meets the pipe here
                if stream is not None:
                    stream.flush()
        except BrokenPipeError:
            raise
        except OSError:  # a terminal that hung up (SIGHUP: the command reported it)
            to_devnull(sys.stdout, sys.stderr)
        return status
    except BrokenPipeError:
        # The output's reader left (``asyncrunner run | head -1``): stop as a pipe's writer
        # does, without a traceback (nor another as Python flushes the streams at its exit).
        to_devnull(sys.stdout, sys.stderr)
        return 1


def _command(argv: Sequence[str] | None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list[:1] == ["show"]:
        from ._show import main as show

        return show(args_list[1:])
    if args_list[:1] == ["score"]:
        from ._score import main as score

        return score(args_list[1:])
    if args_list[:1] == ["bench"]:
        from ._bench import main as bench

        return bench(args_list[1:])
    from ._run import build_parser, run_command

    parser, run_parser = build_parser()
    args = parser.parse_args(args_list)
    if args.command is None:
        parser.error("choose a command: run, show, score, bench")
    try:
        return run_command(args, run_parser, args_list)
    except KeyboardInterrupt:
        print("asyncrunner: interrupted", file=sys.stderr)
        return 130
