"""What the commands share: the argument parser class, the one-line usage error, argument types,
loading an agent and making an env from the command line, one-line messages."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import importlib.util
import os
import signal
import sys
import tempfile
import threading
import warnings
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, NoReturn, TypeVar

from .._runner import ELSEWHERE

__all__ = [
    "DEFAULT_ENV",
    "QUIET",
    "Parser",
    "Terminated",
    "UsageError",
    "add_env_options",
    "at_least",
    "check_plot",
    "derive_seeds",
    "kept_handlers",
    "load_agent",
    "make_env",
    "one_line",
    "parse_max_iter",
    "run_until_stopped",
    "stopping",
    "to_devnull",
]

T = TypeVar("T")

DEFAULT_ENV = "l2rpn_case14_sandbox"
# grid2op checks seeds against its integer type (int32).
_MAX_SEED = 2**31 - 1
# Warnings grid2op prints on every run of the default env; nothing a command-line user can act on.
QUIET = ("You are using a development environment", "Numba cannot be loaded")


class Parser(argparse.ArgumentParser):
    """Errors as one line plus a pointer to ``--help``, instead of the whole usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\nTry '{self.prog} --help' for usage.\n")


class UsageError(Exception):
    """A bad argument found after parsing (unknown agent, env that cannot be made, ...)."""


def add_env_options(parser: argparse.ArgumentParser) -> None:
    """``--test`` and ``--backend``, which every command that makes an env takes (``make_env``)."""
    parser.add_argument(
        "--test",
        action=argparse.BooleanOptionalAction,
        default=None,
        help=(
            "use the small test copy of the env shipped in grid2op's wheel (grid2op.make(..., "
            f"test=True)); default: on for {DEFAULT_ENV}, off otherwise"
        ),
    )
    parser.add_argument(
        "--backend",
        choices=("lightsim", "pandapower"),
        default=None,
        help="power flow backend (default: lightsim when lightsim2grid is installed)",
    )


def check_plot(parser: argparse.ArgumentParser, plot: Path) -> None:
    """Reject a ``--plot`` file that cannot be written, before any work."""
    if plot.suffix.lower() != ".png":
        parser.error(f"--plot writes a PNG file: give a name ending in .png, not {plot.name!r}")
    if plot.is_dir():
        parser.error(f"--plot {plot} is a folder: give a file name ending in .png")
    folder = plot.absolute().parent
    if not folder.is_dir():
        what = "is a file" if folder.exists() else "does not exist"
        parser.error(f"--plot {plot}: the folder {folder} {what}; create it or choose another")
    try:
        fd, probe = tempfile.mkstemp(prefix=".asyncrunner-probe-", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        parser.error(f"--plot {plot}: cannot write in {folder} ({exc.strerror or exc})")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        parser.error('--plot needs matplotlib: pip install "asyncrunner[plot]"')


def at_least(minimum: int) -> Any:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


def parse_max_iter(text: str) -> int:
    value = at_least(-1)(text)
    if value == 0:
        raise argparse.ArgumentTypeError("must be >= 1, or -1 for no limit, got 0")
    return int(value)


def derive_seeds(seed: int | None, nb: int) -> tuple[list[int] | None, list[int] | None]:
    if seed is None:
        return None, None
    import numpy as np

    # One (env, agent) pair per episode, drawn in episode order: episode i gets the same seeds
    # whatever the number of episodes.
    pairs = np.random.default_rng(seed).integers(0, _MAX_SEED, size=(nb, 2), endpoint=True)
    return [int(s) for s in pairs[:, 0]], [int(s) for s in pairs[:, 1]]


def load_agent(spec: str) -> Any:
    """``module:Name``, ``path/to/file.py:Name``, or a name from ``grid2op.Agent``."""
    from .._engine._recipe import FACTORY_HINT, agent_recipe

    if ":" not in spec:
        import grid2op.Agent

        agent = getattr(grid2op.Agent, spec, None)
        if agent is None:
            raise UsageError(
                f"--agent {spec!r}: not an agent in grid2op.Agent; {_agent_hint(spec)}your own "
                "agent: module:Name or path/to/file.py:Name"
            )
    else:
        where, _, attr = spec.rpartition(":")
        if not where or not attr:
            raise UsageError(f"--agent {spec!r}: expected module:Name or path/to/file.py:Name")
        module = _import_file(where, attr) if where.endswith(".py") else _import_module(where)
        agent = module
        for part in attr.split("."):
            agent = getattr(agent, part, None)
            if agent is None:
                raise UsageError(f"--agent {spec!r}: {where} has no attribute {attr!r}")
    try:
        agent_recipe(agent)  # the runner's own checks (a BaseAgent subclass, not abstract, ...)
    except TypeError as exc:
        hint = (
            "bind the rest in your module, such as make_agent = functools.partial(MyAgent, "
            "arg=...), and pass --agent module:make_agent"
        )
        raise UsageError(f"--agent {spec!r}: {str(exc).replace(FACTORY_HINT, hint)}") from None
    return agent


def _agent_hint(spec: str) -> str:
    """ "did you mean X? " for a grid2op agent named with a typo, a call or its module."""
    import difflib

    import grid2op.Agent

    names = [n for n in dir(grid2op.Agent) if n[:1].isupper()]
    bare = spec.removesuffix("()").rpartition(".")[2]  # "RandomAgent()", "grid2op.Agent.X"
    close = difflib.get_close_matches(bare, names, n=1, cutoff=0.6)
    if not close:
        lower = {n.lower(): n for n in names}
        close = [lower[bare.lower()]] if bare.lower() in lower else []
    return f"did you mean {close[0]!r}? " if close else ""


def _import_module(name: str) -> Any:
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` does, so local modules are found
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and (name == exc.name or name.startswith(exc.name + ".")):
            raise UsageError(f"--agent: no module named {name!r}") from None
        raise UsageError(f"--agent: importing {name!r} failed: {_import_error(exc)}") from None
    except Exception as exc:
        raise UsageError(f"--agent: importing {name!r} failed: {_import_error(exc)}") from None


def _import_file(path: str, attr: str) -> Any:
    if not os.path.isfile(path):
        raise UsageError(f"--agent: no such file {path!r}")
    folder, stem = os.path.split(os.path.abspath(path)[: -len(".py")])
    known = sys.modules.get(stem)
    if known is not None and os.path.abspath(getattr(known, "__file__", "") or "") != (
        os.path.join(folder, stem + ".py")
    ):
        raise UsageError(
            f"--agent: {path!r} has the same name as the module {stem!r} already loaded (one "
            "command loads one module of a name, its imports too): copy it under another name, "
            "such as agent_v2.py, or run one command per version"
        )
    # Workers import the agent's module by name (pickle), and receive our sys.path when they start.
    sys.path.insert(0, folder)
    try:
        return importlib.import_module(stem)
    except Exception as exc:
        hint = ""
        package = os.path.basename(folder)
        if isinstance(exc, ImportError) and os.path.isfile(os.path.join(folder, "__init__.py")):
            # (a starting kit's submission/agent.py, with `from .utils import ...`)
            hint = (
                f" ({path!r} is in the package {package!r}: from the folder that holds it, "
                f"give it as a module, --agent {package}.{stem}:{attr})"
            )
        raise UsageError(
            f"--agent: importing {path!r} failed: {_import_error(exc)}{hint}"
        ) from None


def _import_error(exc: Exception) -> str:
    """One line for an error raised while importing the agent's code, with where it happened."""
    import traceback

    if isinstance(exc, SyntaxError):
        return f"SyntaxError: {exc.msg} ({exc.filename}, line {exc.lineno})"
    where = ""
    frames = traceback.extract_tb(exc.__traceback__)
    if frames:
        last = frames[-1]
        where = f" ({last.filename}, line {last.lineno})"
    return f"{type(exc).__name__}: {exc}{where}"


def _check_env_name(name: str, test: bool) -> None:
    """Reject a name grid2op does not know offline, before grid2op tries to download it
    (about 20 s of retries without a network), and suggest the closest known name."""
    import difflib

    import grid2op

    if os.path.exists(name):
        return
    if os.sep in name or (os.altsep is not None and os.altsep in name):
        raise UsageError(f"no env folder {name!r}: give an env name or an existing folder")
    tests = sorted(grid2op.list_available_test_env())
    local_dir = grid2op.get_current_local_dir()
    local = []
    if os.path.isdir(local_dir):
        local = sorted(
            e for e in os.listdir(local_dir) if os.path.isdir(os.path.join(local_dir, e))
        )
    known = tests if test else local
    if name in known:
        return
    if name in tests:  # without --test grid2op would download the full dataset
        raise UsageError(
            f"env {name!r} is not downloaded (not in {local_dir}): add --test for the small copy "
            f"shipped with grid2op, or run grid2op.make({name!r}) once to download the dataset"
        )
    known = sorted({*tests, *local})
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    hint = f"did you mean {close[0]!r}? " if close else ""
    if test:
        raise UsageError(f"unknown env {name!r}: {hint}(--test knows grid2op's test envs)")
    make = "grid2op.make(<its name>)" if close else f"grid2op.make({name!r})"
    raise UsageError(
        f"unknown env {name!r}: {hint}(known offline: grid2op's test envs and the folders in "
        f"{local_dir}; to download another grid2op dataset, run {make} once)"
    )


def make_env(name: str, *, test: bool | None, backend: str | None) -> Any:
    with warnings.catch_warnings():
        for message in QUIET:
            warnings.filterwarnings("ignore", message=message)
        import grid2op
        from grid2op.Exceptions import Grid2OpException

        if test is None:
            test = name == DEFAULT_ENV
        _check_env_name(name, test)
        kwargs: dict[str, Any] = {"test": test}
        backend_obj = _backend(backend)
        if backend_obj is not None:
            kwargs["backend"] = backend_obj
        try:
            return grid2op.make(name, **kwargs)
        except Grid2OpException as exc:
            text = str(exc).strip()
            if text.startswith(type(exc).__name__):  # grid2op's errors repeat their class name
                text = text[len(type(exc).__name__) :].strip().strip('"')
            first = text.splitlines()[0] if text else type(exc).__name__
            hint = "" if test else " (add --test for the copy shipped with grid2op)"
            raise UsageError(f"cannot make env {name!r}: {first}{hint}") from None


def _backend(name: str | None) -> Any:
    if name == "pandapower":
        return None  # grid2op's default
    try:
        from lightsim2grid import LightSimBackend
    except ImportError:
        if name == "lightsim":
            raise UsageError(
                "--backend lightsim needs lightsim2grid: pip install lightsim2grid"
            ) from None
        return None
    return LightSimBackend()


# The library's messages name its arguments; on the command line they are these options (and
# what only Python offers goes).
_OPTIONS = {
    "`nb_scenario`": "--nb-scenario",
    "`path_save`": "--save",
    "`cache_dir`": "--cache-dir",
    ELSEWHERE: "",
    "workers=": "--workers ",
}


def as_options(message: str) -> str:
    """``message`` with the library's argument names replaced by the CLI's options."""
    for argument, option in _OPTIONS.items():
        message = message.replace(argument, option)
    return message


def one_line(text: str, limit: int = 80) -> str:
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 1] + "…"


class Terminated(KeyboardInterrupt):
    """The command got SIGTERM (``kill``, ``timeout``, ``docker stop``, a batch system's time
    limit) or SIGHUP (its terminal closed, without ``nohup``); caught where Ctrl-C is, exit
    status 128 + the signal's number (143, 129)."""

    def __init__(self, signum: int = signal.SIGTERM) -> None:
        super().__init__(signum)
        self.signum = signum
        self.status = 128 + signum
        self.why = "hung up (SIGHUP)" if signum == getattr(signal, "SIGHUP", None) else "terminated"


# The signals a job is ended with, which stop a command as Ctrl-C does (``stopping``).
_STOPS: tuple[signal.Signals, ...] = tuple(
    getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name)
)


def _stop_signals(extra: tuple[signal.Signals, ...] = ()) -> list[signal.Signals]:
    """The stopping signals (and ``extra``) this process has not chosen to ignore (``nohup``
    ignores SIGHUP, a background job SIGINT)."""
    signums = (*_STOPS, *extra)
    return [signum for signum in signums if signal.getsignal(signum) is not signal.SIG_IGN]


@contextlib.contextmanager
def kept_handlers(
    extra: tuple[signal.Signals, ...] = (),
) -> Iterator[list[signal.Signals]]:
    """``_stop_signals(extra)``, whose handlers as they are come back after the block."""
    previous = {signum: signal.getsignal(signum) for signum in _stop_signals(extra)}
    try:
        yield list(previous)
    finally:
        for signum, before in previous.items():  # (None: set outside Python)
            signal.signal(signum, signal.SIG_DFL if before is None else before)


@contextlib.contextmanager
def stopping(
    handler: Callable[[int, Any], None], extra: tuple[signal.Signals, ...] = ()
) -> Iterator[None]:
    """``handler`` for ``_stop_signals(extra)`` in the block, the handlers before it after."""
    with kept_handlers(extra) as signums:
        for signum in signums:
            signal.signal(signum, handler)
        yield


def run_until_stopped(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)``, which SIGTERM or SIGHUP stops as Ctrl-C does: ``main`` is cancelled
    (the runner stops its workers and removes its temporary folders), then ``Terminated`` is
    raised. They ended the process at once: not a word, nothing listed, temporary folders left.
    Ctrl-C cancels ``main``, as asyncio does, then ``KeyboardInterrupt``; a second one changes
    nothing (asyncio's raised in the middle of the runner's stop: its sinks were cancelled, and
    anyio's worker threads, never stopped, kept the process at exit), SIGTERM still does."""
    got: list[int] = []
    pid = os.getpid()

    async def stoppable() -> T:
        loop, task = asyncio.get_running_loop(), asyncio.current_task()
        assert task is not None  # (asyncio.run's)

        def terminate(signum: int, frame: object) -> None:
            if os.getpid() != pid:  # a worker forked meanwhile: its runner stops it
                return
            if signum == signal.SIGINT and signum in got:
                return  # Ctrl-C again: the run is stopping (SIGTERM still hurries it)
            got.append(signum)
            loop.call_soon_threadsafe(task.cancel)

        if threading.current_thread() is not threading.main_thread():
            return await main  # (signals reach the main thread only)
        # signal.signal, not the loop's add_signal_handler: Windows' loops have none, and the
        # handler the process had comes back after.
        with stopping(terminate, (signal.SIGINT,)):
            return await main

    try:
        return asyncio.run(stoppable())
    except asyncio.CancelledError:
        ended = [signum for signum in got if signum != signal.SIGINT]
        if ended:
            raise Terminated(ended[0]) from None
        if got:
            raise KeyboardInterrupt from None
        raise


def to_devnull(*streams: Any) -> None:
    """What is still written to ``streams``, and flushed at exit, goes nowhere instead of
    raising: their reader left (``| head``; ``| tee`` stopped by the same Ctrl-C), or their
    terminal hung up."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        for stream in streams:
            with contextlib.suppress(AttributeError, OSError, ValueError):
                os.dup2(devnull, stream.fileno())
    finally:
        os.close(devnull)
