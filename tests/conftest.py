from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import pytest

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import grid2op

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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # The fast tier (the default) leaves the slow tests out; --run-slow runs everything.
    if config.getoption("--run-slow"):
        return
    slow = [item for item in items if item.get_closest_marker("slow") is not None]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if item.get_closest_marker("slow") is None]


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def make_env(name: str = "l2rpn_case14_sandbox", **kwargs: Any) -> Any:
    """A real env shipped in grid2op's wheel (``test=True``), on LightSim when installed."""
    if LightSimBackend is not None and "backend" not in kwargs:
        kwargs["backend"] = LightSimBackend()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return grid2op.make(name, test=True, **kwargs)


@pytest.fixture
def env() -> Iterator[Any]:
    e = make_env()
    yield e
    e.close()
