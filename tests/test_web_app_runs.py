"""examples/web_app.py's runs as a client sees them: seeds as the CLI derives them, a bounded
episode count, cancelled episodes, and viewers that leave. The app is served by uvicorn on
127.0.0.1 in this test's event loop (real sockets, so a closed stream is seen by the server)."""

from __future__ import annotations

import importlib.util
import socket
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest

httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")
pytest.importorskip("starlette")

from asyncrunner._cli._common import derive_seeds as _derive_seeds  # noqa: E402  (after the skips)

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "web_app.py"
pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # uvicorn serves on asyncio


def _load_example() -> Any:
    spec = importlib.util.spec_from_file_location("asyncrunner_web_app_runs", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@asynccontextmanager
async def serving() -> AsyncIterator[Any]:
    """The example's app under uvicorn on a free port; yields an httpx client for it."""
    app = _load_example().create_app(agent="DoNothingAgent", workers=2)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    async with anyio.create_task_group() as group:
        group.start_soon(server.serve)
        with anyio.fail_after(120):
            while not server.started:  # noqa: ASYNC110  (uvicorn has no event for it)
                await anyio.sleep(0.05)
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
                yield client
        finally:
            server.should_exit = True


async def _wait_for(client: Any, run_id: str, predicate: Any) -> dict[str, Any]:
    with anyio.fail_after(120):
        while True:
            state: dict[str, Any] = (await client.get(f"/runs/{run_id}")).json()
            if predicate(state):
                return state
            await anyio.sleep(0.05)


async def test_too_many_episodes_are_refused_with_the_bound() -> None:
    app = _load_example().create_app(agent="DoNothingAgent", workers=2)
    transport = httpx.ASGITransport(app=app)  # refused before any run starts: no lifespan needed
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        response = await client.post("/runs", json={"episodes": 100000})
        assert response.status_code == 400
        assert response.json()["error"] == (
            "`episodes` must be an integer from 1 to 1000, got 100000"
        )
        assert (await client.post("/runs", json={"episodes": 1000, "seed": -1})).status_code == 400


async def test_seed_gives_the_command_lines_seeds() -> None:
    async with serving() as client:
        response = await client.post("/runs", json={"episodes": 3, "max_iter": 3, "seed": 0})
        state = await _wait_for(client, response.json()["id"], lambda s: s["state"] != "running")
    assert state["state"] == "finished", state
    env_seeds, agent_seeds = _derive_seeds(0, 3)
    assert [r["env_seed"] for r in state["results"]] == env_seeds
    assert [r["agent_seed"] for r in state["results"]] == agent_seeds


async def test_cancelled_run_has_no_running_episode() -> None:
    async with serving() as client:
        run_id = (await client.post("/runs", json={"episodes": 6})).json()["id"]
        await _wait_for(client, run_id, lambda s: any(p["steps"] > 0 for p in s["progress"]))
        body = (await client.delete(f"/runs/{run_id}")).json()
        page = (await client.get("/")).text
    assert body["state"] == "cancelled"
    states = [p["state"] for p in body["progress"]]
    assert "cancelled" in states and "running" not in states, states
    # The page marks them too when the stream's `end` says the run was cancelled.
    assert 'eps[i].state = "cancelled"' in page


async def test_viewers_counts_open_streams() -> None:
    async with serving() as client:
        run_id = (await client.post("/runs", json={"episodes": 2})).json()["id"]
        async with client.stream("GET", f"/runs/{run_id}/events") as stream:
            async for chunk in stream.aiter_text():
                assert "event: run" in chunk
                break
            assert (await client.get(f"/runs/{run_id}")).json()["viewers"] == 1
        # The server sees the closed connection.
        await _wait_for(client, run_id, lambda s: s["viewers"] == 0)
        await client.delete(f"/runs/{run_id}")


@pytest.mark.slow
async def test_page_chart_has_a_legend_and_ticks(tmp_path: Path) -> None:
    import shutil
    import subprocess

    binary = shutil.which("chromium")
    if binary is None:
        pytest.skip("chromium is not installed (bash .ci/run installs it with apt-get)")
    async with serving() as client:
        run = (await client.post("/runs", json={"episodes": 4, "max_iter": 200, "seed": 0})).json()
        page = f"{client.base_url}?run={run['id']}"
        command = [
            binary,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--no-first-run",
            f"--user-data-dir={tmp_path / 'profile'}",
            "--virtual-time-budget=120000",  # waits for the event stream, which ends with the run
            "--dump-dom",
            page,
        ]
        done = await anyio.to_thread.run_sync(
            lambda: subprocess.run(command, capture_output=True, text=True, timeout=240, check=True)
        )
    chart = done.stdout.split('<svg id="chart"', 1)[1].split("</svg>", 1)[0]
    # A legend entry per episode, the repeated chronic included, and round ticks on both axes.
    for label in ("episode 0 (0000)", "episode 1 (0001)", "episode 2 (0002)", "episode 3 (0000)"):
        assert label in chart, chart
    assert all(f">{x}</text>" in chart for x in (0, 50, 100, 150, 200)), chart
    assert ">cumulative reward</text>" in chart and ">step</text>" in chart
    assert chart.count("<path d=") == 4
