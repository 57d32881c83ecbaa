"""examples/web_app.py against the real app: in process (httpx's ASGI transport), served by
uvicorn on 127.0.0.1, and loaded by headless Chromium during a run."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import psutil  # type: ignore[import-untyped]
import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
asgi_lifespan = pytest.importorskip("asgi_lifespan")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "web_app.py"
pytestmark = pytest.mark.anyio


def _load_example() -> Any:
    spec = importlib.util.spec_from_file_location("asyncrunner_web_app_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _cpu_ticks(pid: int) -> int | None:
    """utime + stime of a live process, ``None`` once it is gone (or a zombie)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[11]) + int(fields[12])


async def _stopped(pid: int) -> bool:
    """The process is gone, or uses no CPU over half a second (an idle worker)."""
    before = _cpu_ticks(pid)
    if before is None:
        return True
    await anyio.sleep(0.5)
    after = _cpu_ticks(pid)
    return after is None or after == before


def _parse_sse(text: str) -> list[tuple[str, dict[str, Any]]]:
    events = []
    for block in text.split("\n\n"):
        kind, data = None, None
        for line in block.splitlines():
            if line.startswith("event: "):
                kind = line[len("event: ") :]
            elif line.startswith("data: "):
                data = json.loads(line[len("data: ") :])
        if kind is not None and data is not None:
            events.append((kind, data))
    return events


async def _read_events(client: Any, run_id: str) -> list[tuple[str, dict[str, Any]]]:
    # No read timeout: the stream lasts as long as the run (a busy machine builds envs slowly).
    async with client.stream("GET", f"/runs/{run_id}/events", timeout=None) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        text = "".join([chunk async for chunk in response.aiter_text()])
    return _parse_sse(text)


async def scenario(client: Any, max_latency: float | None = None) -> None:
    """Start a run and read its events to the end while other requests are answered (within
    ``max_latency`` seconds if given: a wall-clock bound, for the slow tier only); then cancel
    a second run and see its workers stop."""
    bad = await client.post("/runs", json={"episodes": 0})
    assert bad.status_code == 400 and "episodes" in bad.json()["error"]
    assert (await client.get("/runs/nope")).status_code == 404

    response = await client.post("/runs", json={"episodes": 2, "max_iter": 30, "seed": 1})
    assert response.status_code == 201, response.text
    run_id = response.json()["id"]

    latencies: list[float] = []
    events: list[tuple[str, dict[str, Any]]] = []

    async def read() -> None:
        events.extend(await _read_events(client, run_id))

    async with anyio.create_task_group() as group:
        group.start_soon(read)
        while True:
            start = time.perf_counter()
            health = await client.get("/health")
            latencies.append(time.perf_counter() - start)
            assert health.status_code == 200
            if (await client.get(f"/runs/{run_id}")).json()["state"] != "running":
                break
            await anyio.sleep(0.05)
    assert max_latency is None or max(latencies) < max_latency, latencies

    kinds = [kind for kind, _ in events]
    assert kinds[0] == "run" and kinds[-1] == "end"
    assert kinds.count("episode_started") == 2 and kinds.count("episode_finished") == 2
    end = events[-1][1]
    assert end["state"] == "finished", end
    results = end["results"]
    assert [r["index"] for r in results] == [0, 1]
    assert all(r["error"] is None and r["nb_time_step"] == 30 for r in results)
    # The streamed steps add up to the results.
    for r in results:
        rewards = [
            x
            for kind, d in events
            if kind == "steps" and d["index"] == r["index"]
            for x in d["rewards"]
        ]
        assert len(rewards) == r["nb_time_step"]
        assert sum(rewards) == pytest.approx(r["cum_reward"], rel=1e-5)
    state = (await client.get(f"/runs/{run_id}")).json()
    assert state["state"] == "finished" and state["results"] == results
    assert state["finished_episodes"] == 2

    # A second, long run: cancel it once its episodes play.
    response = await client.post("/runs", json={"episodes": 8})
    second = response.json()["id"]
    with anyio.fail_after(60):
        while True:
            progress = (await client.get(f"/runs/{second}")).json()["progress"]
            if any(p["steps"] > 0 for p in progress):
                break
            await anyio.sleep(0.02)
    cancelled = await client.delete(f"/runs/{second}")
    assert cancelled.status_code == 200
    body = cancelled.json()
    assert body["state"] == "cancelled"
    assert body["finished_episodes"] < 8
    pids = {p["worker"] for p in body["progress"] if p["state"] == "cancelled"}
    assert pids
    with anyio.fail_after(20):
        for pid in pids:
            while not await _stopped(pid):
                pass
    # Its event stream ends with the cancellation.
    kinds_ = [kind for kind, _ in await _read_events(client, second)]
    assert kinds_[-1] == "end"
    assert (await client.get(f"/runs/{second}")).json()["state"] == "cancelled"


async def test_asgi_app() -> None:
    module = _load_example()
    app = module.create_app(agent="DoNothingAgent", workers=2)
    t0 = time.perf_counter()
    async with asgi_lifespan.LifespanManager(app, startup_timeout=120, shutdown_timeout=60) as m:
        print(f"started: {time.perf_counter() - t0:.1f} s")
        transport = httpx.ASGITransport(app=m.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            page = await client.get("/")
            assert page.status_code == 200 and "<svg" in page.text and "EventSource" in page.text
            assert "http://" not in page.text.replace('"http://www.w3.org', "")  # no external asset
            await scenario(client)
            print(f"scenario done: {time.perf_counter() - t0:.1f} s")
    print(f"shut down: {time.perf_counter() - t0:.1f} s")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def serving(tmp_path: Path) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """``python examples/web_app.py`` on a free port of 127.0.0.1 (as the README runs it); stopped
    with SIGTERM at the end, which it must answer by shutting the app down."""
    port = _free_port()
    log = (tmp_path / "server.log").open("w")
    process = subprocess.Popen(
        [sys.executable, str(EXAMPLE), "--port", str(port), "--workers", "2"],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=tmp_path,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, (tmp_path / "server.log").read_text()
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.2)
        yield url, process
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:  # pragma: no cover
            process.kill()
            process.wait()
        log.close()
    # uvicorn shuts the app down (lifespan: runner closed), then re-raises the signal.
    text = (tmp_path / "server.log").read_text()
    assert process.returncode in (0, -signal.SIGTERM), text
    assert "Application shutdown complete" in text, text


@pytest.fixture
def server(tmp_path: Path) -> Iterator[str]:
    with serving(tmp_path) as (url, _):
        yield url


@pytest.mark.slow  # a uvicorn server process
async def test_the_server_stops_promptly_while_someone_watches_a_run(tmp_path: Path) -> None:
    # uvicorn waits for open connections before it shuts the app down, and a viewer's event
    # stream stayed open until its run ended: SIGTERM (docker stop, systemd) waited for the
    # whole run (up to 1,000 episodes) while it went on playing.
    with serving(tmp_path) as (url, process):
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            run_id = (await client.post("/runs", json={"episodes": 1000})).json()["id"]
            playing = anyio.Event()

            async def watch() -> None:  # as the dashboard does, to the end of the stream
                with contextlib.suppress(httpx.TransportError):
                    async with client.stream("GET", f"/runs/{run_id}/events") as events:
                        async for line in events.aiter_lines():
                            if line.startswith("event: episode_finished"):
                                playing.set()

            async with anyio.create_task_group() as group:
                group.start_soon(watch)
                await playing.wait()
                workers = [p.pid for p in psutil.Process(process.pid).children()]
                assert workers
                started = time.monotonic()
                process.terminate()
                await anyio.to_thread.run_sync(process.wait, 30)
                stopped = time.monotonic() - started
    assert stopped < 10, f"the server took {stopped:.1f} s to stop"
    assert not [pid for pid in workers if psutil.pid_exists(pid)]


def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


def _browser(binary: str, profile: Path, *args: str) -> list[str]:
    return [
        binary,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        f"--user-data-dir={profile}",
        # Virtual time waits for pending requests: the page's event stream ends with the run.
        "--virtual-time-budget=120000",
        "--window-size=900,800",
        *args,
    ]


def _browse(binary: str, page: str, shot: Path) -> str:
    """Two headless Chromiums load ``page`` at once: one dumps its DOM, one takes a screenshot;
    both return when the page's event stream has ended (the run is over)."""
    dump = subprocess.Popen(
        _browser(binary, shot.parent / "profile-dom", "--dump-dom", page),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    picture = subprocess.Popen(
        _browser(binary, shot.parent / "profile-shot", f"--screenshot={shot}", page),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=shot.parent,
    )
    try:
        dom, _ = dump.communicate(timeout=180)
        picture.wait(180)
    finally:
        for p in (dump, picture):
            if p.poll() is None:  # pragma: no cover
                p.kill()
                p.wait()
    assert dump.returncode == 0 and picture.returncode == 0
    return dom


@pytest.mark.slow  # a uvicorn server process and two headless Chromiums
async def test_uvicorn_and_browser(server: str, tmp_path: Path) -> None:
    async with httpx.AsyncClient(base_url=server, timeout=60) as client:
        t0 = time.perf_counter()
        await scenario(client, max_latency=1.0)
        print(f"scenario: {time.perf_counter() - t0:.1f} s")

        binary = _chromium()
        if binary is None:
            pytest.skip("chromium is not installed (bash .ci/run installs it with apt-get)")
        # A run the browser follows while it plays.
        response = await client.post("/runs", json={"episodes": 4, "seed": 0})
        run_id = response.json()["id"]
        page = f"{server}/?run={run_id}"
        shot = tmp_path / "dashboard.png"
        dom = await anyio.to_thread.run_sync(_browse, binary, page, shot)
        state = (await client.get(f"/runs/{run_id}")).json()
        assert state["state"] == "finished"
        # Both browsers' event streams are closed.
        assert state["viewers"] == 0
        total = sum(r["nb_time_step"] for r in state["results"])
        assert '<b id="status" class="finished">finished</b>' in dom, dom
        assert '<b id="episodes-done">4/4</b>' in dom
        assert f'<b id="steps">{total}</b>' in dom
        assert dom.count('<path d="M') == 4  # one reward curve per episode
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 5000
        print(f"screenshot: {shot}")
