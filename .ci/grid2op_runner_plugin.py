"""pytest plugin for .ci/grid2op-runner-tests: grid2op's Runner tests, on asyncrunner.compat.Runner.

Loaded with ``-p grid2op_runner_plugin`` (this folder on ``PYTHONPATH``), so it runs before any test
module is imported. It reads two environment variables:

- ``ASYNCRUNNER_G2O_DATA_TEST``: grid2op's ``data_test`` folder (not in grid2op's wheel). The
  names ``grid2op.tests.helper_path_test`` computes from it (``PATH_DATA_TEST``, ``PATH_CHRONICS``,
  ...) are set to this folder before the tests ``import *`` them.
- ``ASYNCRUNNER_G2O_RUNNER``: ``compat`` (default) puts ``asyncrunner.compat.Runner`` in place of
  ``grid2op.Runner.Runner`` and ``grid2op.Runner.runner.Runner``; ``grid2op`` leaves grid2op's own
  Runner (the baseline run).

Then it checks, before any test runs, that every collected module's ``Runner`` is the expected
class (the session stops otherwise), and at the end that ``compat.Runner`` was really used: it
counts the calls to its ``run`` / ``run_one_episode`` and fails the session if there were none.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import pytest

MODE = os.environ.get("ASYNCRUNNER_G2O_RUNNER", "compat")
if MODE not in ("compat", "grid2op"):
    raise pytest.UsageError(f"ASYNCRUNNER_G2O_RUNNER={MODE!r}: expected 'compat' or 'grid2op'")

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import grid2op.Runner
    import grid2op.Runner.runner
    import grid2op.tests.helper_path_test as helper

    import asyncrunner.compat

GRID2OP_RUNNER = grid2op.Runner.runner.Runner
EXPECTED: type = asyncrunner.compat.Runner if MODE == "compat" else GRID2OP_RUNNER
# Calls of compat.Runner's entry points, and runs that reached asyncrunner's worker processes
# (``_ar_call``; the others played in-process with grid2op's code, see compat's documentation).
CALLS = {"run": 0, "run_one_episode": 0, "_run_sequential": 0, "_run_parrallel": 0, "_ar_call": 0}


def _point_helper_at(data_test: str) -> None:
    """Set the paths grid2op's helper_path_test derives from its ``data_test`` folder."""
    data_test = os.path.abspath(data_test)
    if not os.path.isdir(os.path.join(data_test, "5bus_example")):
        raise pytest.UsageError(f"{data_test} is not grid2op's data_test folder (no 5bus_example)")
    paths = {
        "data_test_dir": data_test,
        "PATH_DATA_TEST": data_test,
        "PATH_CHRONICS": data_test,
        "PATH_DATA_TEST_PP": os.path.join(data_test, "test_PandaPower"),
        "EXAMPLE_CHRONICSPATH": os.path.join(data_test, "5bus_example", "chronics"),
        "EXAMPLE_CASEFILE": os.path.join(data_test, "5bus_example", "5bus_example.json"),
        "PATH_DATA_MULTIMIX": os.path.join(data_test, "multimix"),
    }
    for name, value in paths.items():
        assert hasattr(helper, name), f"grid2op's helper_path_test has no {name}"
        setattr(helper, name, value)


def _count(name: str) -> None:
    original = getattr(asyncrunner.compat.Runner, name)

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        CALLS[name] += 1
        return original(self, *args, **kwargs)

    counted.__wrapped__ = original  # type: ignore[attr-defined]
    setattr(asyncrunner.compat.Runner, name, counted)


_point_helper_at(os.environ["ASYNCRUNNER_G2O_DATA_TEST"])
if MODE == "compat":
    grid2op.Runner.Runner = asyncrunner.compat.Runner
    grid2op.Runner.runner.Runner = asyncrunner.compat.Runner
    for _name in CALLS:
        _count(_name)


def pytest_report_header(config: pytest.Config) -> list[str]:
    return [
        f"grid2op {grid2op.__version__} from {os.path.dirname(grid2op.__file__)}",
        f"Runner under test: {EXPECTED.__module__}.{EXPECTED.__qualname__}",
        f"asyncrunner from {os.path.dirname(asyncrunner.__file__)}",
        f"data_test: {helper.PATH_DATA_TEST}",
    ]


def pytest_collection_finish(session: pytest.Session) -> None:
    """Stop before any test runs if a test module holds another Runner than the one under test."""
    wrong = []
    if grid2op.Runner.Runner is not EXPECTED or grid2op.Runner.runner.Runner is not EXPECTED:
        wrong.append(f"grid2op.Runner.Runner is {grid2op.Runner.Runner!r}")
    modules: set[Any] = {getattr(item, "module", None) for item in session.items} - {None}
    for module in modules:
        runner = getattr(module, "Runner", None)
        if runner is not EXPECTED:
            wrong.append(f"{module.__name__}.Runner is {runner!r}")
        for name in ("PATH_DATA_TEST", "data_test_dir", "PATH_CHRONICS", "PATH_DATA_TEST_PP"):
            value = getattr(module, name, None)
            if value is not None and value != getattr(helper, name):
                wrong.append(f"{module.__name__}.{name} is {value!r}")
    if wrong:
        pytest.exit("not testing the intended Runner / data_test: " + "; ".join(wrong), 3)


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    if MODE == "compat":
        counts = " ".join(f"{name}={n}" for name, n in CALLS.items() if name != "_ar_call")
        terminalreporter.write_line(
            f"asyncrunner.compat.Runner calls: {counts}; runs played in asyncrunner's worker "
            f"processes: {CALLS['_ar_call']}"
        )
