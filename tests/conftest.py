from __future__ import annotations

import hashlib
import importlib.metadata
import inspect
import os
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import grid2op
    from grid2op.Runner import Runner

    from .helpers import grid2ops  # imports grid2op's agents

try:
    from lightsim2grid import LightSimBackend as LightSimBackend  # re-exported to the tests
except ImportError:  # pragma: no cover - lightsim is in the test extra
    LightSimBackend = None


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--run-slow",
        action="store_true",
        help="also run the slow tier (marked slow: subprocesses, notebook, browser, Dask, soak, ...)",
    )


# The longest modules (the durations .ci/run lists), first: xdist hands out whole modules in
# collection order, and the workers end together when the last ones handed out are short.
_LONGEST_FIRST = ("test_readme_commands", "test_parity", "test_score", "test_compat")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(_LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))  # stable: modules stay whole
    # The fast tier (the default) leaves the slow tests out; --run-slow runs everything.
    if config.getoption("--run-slow"):
        return
    slow = [item for item in items if item.get_closest_marker("slow") is not None]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if item.get_closest_marker("slow") is None]


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    """asyncio only; a module (or test) where the loop matters asks for trio too (BOTH_LOOPS)."""
    return "asyncio"


@pytest.fixture(autouse=True)
def _on_the_loop_asked_for(request: pytest.FixtureRequest) -> None:
    # anyio's plugin keeps one event loop while any async fixture holds it, whatever backend a
    # later test asks for: a trio test next to a warm asyncio runner would silently run on
    # asyncio. Fail it instead (the warm runner's fixture must depend on the module's backend).
    if (
        request.node.get_closest_marker("anyio") is None
        or "anyio_backend" not in request.fixturenames
    ):
        return
    import anyio.pytest_plugin

    current = getattr(anyio.pytest_plugin, "_current_runner", None)
    backend = request.getfixturevalue("anyio_backend")
    if current is not None and f"._{backend}" not in type(current).__module__:
        pytest.fail(
            f"a {type(current).__module__} loop is still held: this {backend} test would run on it"
        )


def make_env(name: str = "l2rpn_case14_sandbox", **kwargs: Any) -> Any:
    """A new real env shipped in grid2op's wheel (``test=True``), on LightSim when installed."""
    if LightSimBackend is not None and "backend" not in kwargs:
        kwargs["backend"] = LightSimBackend()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return grid2op.make(name, test=True, **kwargs)


@pytest.fixture(scope="session")
def wheel_env() -> Iterator[Callable[..., Any]]:
    """``wheel_env(name, **make_kwargs)``: one env per session for each name and arguments.

    Shared: read it, never change it (a test that changes its env takes ``env.copy()``).
    """
    made: dict[str, Any] = {}

    def get(name: str = "l2rpn_case14_sandbox", **kwargs: Any) -> Any:
        key = repr((name, sorted(kwargs.items())))
        if key not in made:
            made[key] = make_env(name, **kwargs)
        return made[key]

    yield get
    for env in made.values():
        env.close()


@pytest.fixture(scope="session")
def env(wheel_env: Callable[..., Any]) -> Any:
    """The session's l2rpn_case14_sandbox env (read-only: take ``env.copy()`` to change it)."""
    return wheel_env()


def _versions() -> str:
    names = ["grid2op", "lightsim2grid", "numpy", "pandapower"]
    found = []
    for name in names:
        try:
            found.append(f"{name}={importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            found.append(f"{name}=none")
    return " ".join(found)


@pytest.fixture(scope="session")
def grid2op_reference(request: pytest.FixtureRequest) -> Callable[..., list[tuple[Any, ...]]]:
    """``grid2op_reference(env, agent, **run_kwargs)``: the first five fields of what grid2op's
    Runner gives (``nb_process=1``), computed once per session; kept between sessions in pytest's
    cache, keyed on the versions of grid2op and its solvers and on the agent's source."""
    cache = getattr(request.config, "cache", None)  # None under -p no:cacheprovider
    computed: dict[str, list[tuple[Any, ...]]] = {}

    def reference(env: Any, agent: type[Any], **kwargs: Any) -> list[tuple[Any, ...]]:
        key = repr(
            (
                _versions(),
                env.env_name,
                # the Runner's first field is the chronic's absolute path: a cache written by
                # another venv (another Python, tox/nox) holds another path
                os.path.realpath(env.get_path_env()),
                type(env.backend).__name__,
                env._rewardClass,
                env.get_thermal_limit().tolist(),
                agent,
                inspect.getsource(agent),
                sorted(kwargs.items()),
            )
        )
        if key in computed:
            return computed[key]
        name = "asyncrunner/grid2op/" + hashlib.sha256(key.encode()).hexdigest()[:32]
        stored = cache.get(name, None) if cache is not None else None
        if stored is not None and stored["key"] == key:
            results = [tuple(r) for r in stored["results"]]
        else:
            runner = grid2ops(Runner, **env.get_params_for_runner(), agentClass=agent)
            raw = grid2ops(runner.run, nb_process=1, **kwargs)
            results = [(str(r[0]), str(r[1]), float(r[2]), int(r[3]), int(r[4])) for r in raw]
            if cache is not None:
                cache.set(name, {"key": key, "results": results})
        computed[key] = results
        return results

    return reference
