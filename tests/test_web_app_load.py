"""examples/web_app.py under many viewers: 1,000 event streams follow one run on 127.0.0.1 while
``/health`` is asked every 20 ms. Bounded: 1,000 clients, at most ~20 s of probing, then the run is
cancelled and every stream must end by itself."""

from __future__ import annotations

import http.client
import json
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "web_app.py"
VIEWERS = 1000
PROBE_SECONDS = 20.0

# The viewers, in a process of their own (raw asyncio sockets: cheap enough that 1,000 of them do
# not starve the server on 2 cores). Prints "connected" once every stream got its headers, then
# one JSON line: how many streams saw the run's `end` event and how many bytes each read at least.
CLIENTS = r"""
import asyncio, json, sys

port, run_id, n, deadline = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
request = f"GET /runs/{run_id}/events HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode()


async def viewer(connected, opened):
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request)
    head = await reader.readuntil(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    opened.append(1)
    if len(opened) == n:
        connected.set()
    total, tail = 0, b""
    while True:
        chunk = await reader.read(65536)
        if not chunk:
            break
        total += len(chunk)
        tail = (tail + chunk)[-4096:]
        if b"event: end\n" in tail:
            writer.close()
            return total
    writer.close()
    return None


async def main():
    connected, opened = asyncio.Event(), []
    gate = asyncio.Semaphore(100)  # connections opened at once

    async def one():
        async with gate:
            conn = asyncio.ensure_future(viewer(connected, opened))
            await asyncio.sleep(0.002)
        return await conn

    tasks = [asyncio.ensure_future(one()) for _ in range(n)]
    await asyncio.wait_for(connected.wait(), 60)
    print("connected", flush=True)
    done = await asyncio.wait_for(asyncio.gather(*tasks), deadline)
    ends = [d for d in done if d is not None]
    print(json.dumps({"ended": len(ends), "min_bytes": min(ends, default=0)}), flush=True)


asyncio.run(main())
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _request(port: int, method: str, path: str, body: str = "") -> object:
    # A connection per request: uvicorn closes idle keep-alive connections after 5 s.
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request(method, path, body=body or None)
        response = conn.getresponse()
        data = json.loads(response.read())
    finally:
        conn.close()
    assert response.status < 300, data
    return data


def _probe(port: int, seconds: float) -> list[float]:
    """Latencies of GET /health, asked every 20 ms for ``seconds`` on one keep-alive connection
    (as a browser would: a new connection per probe would time the TCP handshake too)."""
    latencies: list[float] = []
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            start = time.perf_counter()
            conn.request("GET", "/health")
            response = conn.getresponse()
            assert response.status == 200 and json.loads(response.read())["ok"]
            latencies.append(time.perf_counter() - start)
            time.sleep(0.02)
    finally:
        conn.close()
    return latencies


def _stats(latencies: list[float]) -> str:
    ms = sorted(1000 * x for x in latencies)
    p99 = ms[int(0.99 * (len(ms) - 1))]
    return f"{len(ms)} probes, p50 {statistics.median(ms):.1f} ms, p99 {p99:.1f} ms, max {ms[-1]:.1f} ms"


@pytest.fixture
def server(tmp_path: Path) -> Iterator[int]:
    port = _free_port()
    log = (tmp_path / "server.log").open("w")
    process = subprocess.Popen(
        [sys.executable, str(EXAMPLE), "--port", str(port), "--workers", "2"],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=tmp_path,
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, (tmp_path / "server.log").read_text()
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    break
            except OSError:
                assert time.monotonic() < deadline, "the server did not start"
                time.sleep(0.2)
        yield port
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:  # pragma: no cover
            process.kill()
            process.wait()
        log.close()


@pytest.mark.slow
def test_health_stays_fast_with_1000_viewers(server: int) -> None:
    _request(server, "GET", "/health")  # the lifespan (env build, runner) is done
    # Long enough to outlast the probing on a fast machine: the run is cancelled after it.
    run = _request(server, "POST", "/runs", json.dumps({"episodes": 200}))
    assert isinstance(run, dict)
    run_id = run["id"]
    alone = _probe(server, 5.0)  # the same run, no viewer: what the machine's load gives
    clients = subprocess.Popen(
        [sys.executable, "-c", CLIENTS, str(server), run_id, str(VIEWERS), "120"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert clients.stdout is not None
        assert clients.stdout.readline().strip() == "connected"
        state = _request(server, "GET", f"/runs/{run_id}")
        assert isinstance(state, dict)
        assert state["state"] == "running" and state["viewers"] == VIEWERS, state
        latencies = _probe(server, PROBE_SECONDS)
        state = _request(server, "GET", f"/runs/{run_id}")
        assert isinstance(state, dict)
        assert state["state"] == "running", "the run ended before the probing did: make it longer"
        steps = sum(p["steps"] for p in state["progress"])
        _request(server, "DELETE", f"/runs/{run_id}")
        out, _ = clients.communicate(timeout=150)
    finally:
        if clients.poll() is None:  # pragma: no cover
            clients.kill()
            clients.wait()
    with open("/proc/loadavg") as f:
        load = " ".join(f.read().split()[:3])
    print(f"/health during the run, no viewer: {_stats(alone)}")
    print(f"/health with {VIEWERS} viewers: {_stats(latencies)}; {steps} steps streamed meanwhile")
    print(f"load average {load}")
    report = json.loads(out.strip().splitlines()[-1])
    # Every viewer followed the run to its end (the cancellation), steps included.
    assert report["ended"] == VIEWERS, report
    assert report["min_bytes"] > steps * 5, (report, steps)
    after = _request(server, "GET", f"/runs/{run_id}")
    assert isinstance(after, dict) and after["viewers"] == 0, after
