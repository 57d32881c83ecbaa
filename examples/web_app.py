"""A live evaluation dashboard: one long-lived AsyncRunner inside a Starlette app.

Run it with ``python examples/web_app.py [--port 8000] [--workers 2] [--agent DoNothingAgent]``
(or ``uvicorn --app-dir examples web_app:app --timeout-graceful-shutdown 3``) and open
http://127.0.0.1:8000/.

- ``POST /runs`` (JSON ``{"episodes": 2, "max_iter": 100, "seed": 0}``) starts an evaluation in
  the background and answers at once with its id. At most ``MAX_EPISODES`` (1,000) episodes a
  run; ``seed`` derives the episodes' seeds as ``asyncrunner run --seed`` does.
- ``GET /runs/{id}``: its state (``running``, ``finished``, ``failed``, ``cancelled``), the
  progress of each episode and, once done, the results.
- ``GET /runs/{id}/events``: progress as server-sent events (``run``, ``episode_started``,
  ``steps``, ``episode_finished``, ``episode_failed``, then ``end``), from the start of the run;
  ``viewers`` in the run's state counts the streams open. Steps reach viewers at most four times
  a second, each event encoded once for all of them, so 1,000 viewers leave the loop responsive.
- ``DELETE /runs/{id}``: cancels it (its worker processes stop their episodes, which then say
  ``cancelled``).
- ``GET /``: a page showing live progress and a live reward chart (no external assets).

Episodes play in the runner's worker processes; the event loop only relays their events, so the
server keeps answering while runs go on. Worker processes re-import this file (as
``__mp_main__``), so building the app has no side effect: the env and the runner are made in the
app's lifespan.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.lowlevel
import grid2op
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from asyncrunner import (
    AsyncRunner,
    EpisodeFailed,
    EpisodeFinished,
    EpisodeStarted,
    Event,
    RunFinished,
    StepBatch,
)

# The command line's derivation of per-episode seeds: `"seed": N` here plays the episodes that
# `asyncrunner run --seed N` plays.
from asyncrunner._cli._common import derive_seeds

ENV_NAME = "l2rpn_case14_sandbox"
MAX_EPISODES = 1000  # per run: a bigger one would hold the workers (and the run's log) for hours
KEEP_ALIVE = 10.0  # seconds between comments on an idle event stream
SHUTDOWN_GRACE = 3  # seconds a stop waits for open connections (event streams) before cancelling
# Viewers are woken at most this often, this many at a time (see Dashboard._wake_viewers).
WAKE_EVERY = 0.25
WAKE_AT_ONCE = 20


def make_env(name: str = ENV_NAME) -> Any:
    """The env shipped inside grid2op's wheel (``test=True``), on LightSim when installed."""
    kwargs: dict[str, Any] = {}
    try:
        from lightsim2grid import LightSimBackend
    except ImportError:
        pass
    else:
        kwargs["backend"] = LightSimBackend()
    return grid2op.make(name, test=True, **kwargs)


def load_agent(name: str) -> Any:
    """An agent class of ``grid2op.Agent`` by name (``DoNothingAgent``, ``RandomAgent``, ...)."""
    import grid2op.Agent

    agent = getattr(grid2op.Agent, name, None)
    if not isinstance(agent, type):
        raise ValueError(f"unknown agent {name!r}: give a class name of grid2op.Agent")
    return agent


@dataclass
class Run:
    """One evaluation: its state, per-episode progress and the log of events sent to clients."""

    id: str
    episodes: int
    max_iter: int | None
    seed: int | None
    state: str = "running"
    started: float = field(default_factory=time.time)
    ended: float | None = None
    progress: dict[int, dict[str, Any]] = field(default_factory=dict)
    results: list[dict[str, Any]] | None = None
    error: str | None = None
    viewers: int = 0  # event streams open now
    # Server-sent events as sent: each encoded once, whatever the number of viewers.
    log: list[bytes] = field(default_factory=list)
    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)
    over: anyio.Event = field(default_factory=anyio.Event)  # set once state is not running
    waiting: list[anyio.Event] = field(default_factory=list)  # viewers waiting to be woken
    woken_at: int = 0  # len(log) when the viewers were last woken
    woken_time: float = 0.0

    @property
    def done(self) -> bool:
        return self.state != "running"

    def emit(self, kind: str, data: dict[str, Any]) -> None:
        n = len(self.log) + 1
        self.log.append(f"id: {n}\nevent: {kind}\ndata: {json.dumps(data)}\n\n".encode())

    async def wait(self) -> None:
        """Until the viewers are next woken: when the log has grown, or to keep the stream alive."""
        woken = anyio.Event()
        self.waiting.append(woken)
        await woken.wait()

    def summary(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "state": self.state,
            "episodes": self.episodes,
            "max_iter": self.max_iter,
            "seed": self.seed,
            "started": self.started,
            "ended": self.ended,
            "finished_episodes": sum(
                1 for p in self.progress.values() if p["state"] in ("finished", "failed")
            ),
            "progress": [self.progress[i] for i in sorted(self.progress)],
            "results": self.results,
            "error": self.error,
            "viewers": self.viewers,
        }

    def record(self, event: Event) -> None:
        """Turn a runner event into progress and a client event (steps as plain numbers)."""
        if isinstance(event, EpisodeStarted):
            p = {
                "index": event.index,
                "name": event.name,
                "max_ts": event.max_ts,
                "steps": 0,
                "cum_reward": 0.0,
                "state": "running",
                "worker": event.worker,
                "attempt": event.attempt,
            }
            self.progress[event.index] = p
            self.emit("episode_started", dict(p))
        elif isinstance(event, StepBatch):
            p = self.progress[event.index]
            rewards = [_number(r) for r in event.rewards.tolist()]
            p["steps"] = event.first_step + len(event) - 1
            p["cum_reward"] += sum(rewards)
            self.emit(
                "steps",
                {
                    "index": event.index,
                    "first_step": event.first_step,
                    "steps": p["steps"],
                    "rewards": rewards,
                    "cum_reward": p["cum_reward"],
                },
            )
        elif isinstance(event, EpisodeFinished):
            p = self.progress[event.index]
            p.update(state="finished", steps=event.nb_time_step, cum_reward=event.cum_reward)
            self.emit(
                "episode_finished",
                {
                    "index": event.index,
                    "name": event.name,
                    "cum_reward": event.cum_reward,
                    "nb_time_step": event.nb_time_step,
                    "max_ts": event.max_ts,
                },
            )
        elif isinstance(event, EpisodeFailed):
            p = self.progress.setdefault(event.index, {"index": event.index, "steps": 0})
            p["state"] = "retrying" if event.retrying else "failed"
            p["error"] = f"{event.error_type}: {event.message}"
            self.emit(
                "episode_failed",
                {
                    "index": event.index,
                    "error": p["error"],
                    "retrying": event.retrying,
                    "step": event.step,
                },
            )
        elif isinstance(event, RunFinished):
            self.results = [
                {
                    "index": r.index,
                    "name": r.name,
                    "cum_reward": r.cum_reward,
                    "nb_time_step": r.nb_time_step,
                    "max_ts": r.max_ts,
                    "env_seed": r.env_seed,
                    "agent_seed": r.agent_seed,
                    "error": None
                    if r.error is None
                    else f"{r.error.error_type}: {r.error.message}",
                }
                for r in event.results
            ]

    def finish(self, state: str, error: str | None = None) -> None:
        self.state = state
        if state == "cancelled":  # its unfinished episodes were stopped with it
            for p in self.progress.values():
                if p["state"] in ("running", "retrying"):
                    p["state"] = "cancelled"
        self.error = error
        self.ended = time.time()
        self.emit("end", {"state": state, "error": error, "results": self.results})
        self.over.set()


def _number(x: float) -> float | None:
    return x if math.isfinite(x) else None


class Dashboard:
    """The app's state: the runner, its runs, and the task group the runs play in."""

    def __init__(self, env_factory: Callable[[], Any], agent: Any, workers: int) -> None:
        self.env_factory = env_factory
        self.agent = agent
        self.workers = workers
        self.runs: dict[str, Run] = {}
        self.runner: AsyncRunner | None = None
        self._ids = itertools.count(1)
        self._group: Any = None

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        # Building the env parses files: off the event loop.
        env = await anyio.to_thread.run_sync(self.env_factory)
        try:
            async with (
                AsyncRunner(env, agent=self.agent, workers=self.workers) as runner,
                anyio.create_task_group() as group,
            ):
                self.runner, self._group = runner, group
                group.start_soon(self._wake_viewers)
                try:
                    yield
                finally:
                    group.cancel_scope.cancel()
                    self.runner = self._group = None
        finally:
            env.close()

    def start(self, episodes: int, max_iter: int | None, seed: int | None) -> Run:
        assert self.runner is not None and self._group is not None, "the app is not started"
        env_seeds, agent_seeds = derive_seeds(seed, episodes)
        stream = self.runner.stream(
            episodes,
            max_iter=max_iter,
            env_seeds=env_seeds,
            agent_seeds=agent_seeds,
            on_error="continue",
        )
        run = Run(id=str(next(self._ids)), episodes=episodes, max_iter=max_iter, seed=seed)
        self.runs[run.id] = run
        run.emit("run", run.summary())
        self._group.start_soon(self._play, run, stream)
        return run

    async def _play(self, run: Run, stream: Any) -> None:
        try:
            with run.scope:
                async with stream as events:
                    async for event in events:
                        run.record(event)
        except Exception as exc:
            run.finish("failed", f"{type(exc).__name__}: {exc}")
            return
        except BaseException:  # the app shuts down
            run.finish("cancelled")
            raise
        if run.scope.cancel_called:
            run.finish("cancelled")
        else:
            failed = any(r["error"] for r in run.results or [])
            run.finish("failed" if failed else "finished")

    async def _wake_viewers(self) -> None:
        # Waking every viewer on every event costs a write per viewer and event: with 1,000
        # viewers the loop did little else and /health took up to seconds. Woken here instead,
        # at most every WAKE_EVERY seconds (each takes all it missed in one write), and
        # WAKE_AT_ONCE at a time with a pass of the loop between, so requests get their turn.
        while True:
            await anyio.sleep(WAKE_EVERY)
            now = anyio.current_time()
            for run in list(self.runs.values()):
                idle = len(run.log) == run.woken_at
                if not run.waiting or (idle and now - run.woken_time < KEEP_ALIVE):
                    continue
                run.woken_at, run.woken_time = len(run.log), now
                waiting, run.waiting = run.waiting, []
                for i, woken in enumerate(waiting, 1):
                    woken.set()
                    if i % WAKE_AT_ONCE == 0:
                        await anyio.lowlevel.checkpoint()

    # --- endpoints -----------------------------------------------------------------------------

    async def page(self, request: Request) -> Response:
        return HTMLResponse(PAGE)

    async def create_run(self, request: Request) -> Response:
        try:
            body = await request.json() if await request.body() else {}
            if not isinstance(body, dict):
                raise ValueError("the body must be a JSON object")
            episodes = _int(body.get("episodes", 2), "episodes", 1, MAX_EPISODES)
            max_iter = body.get("max_iter")
            max_iter = None if max_iter in (None, -1) else _int(max_iter, "max_iter", 1)
            seed = body.get("seed")
            seed = None if seed is None else _int(seed, "seed", 0)
            run = self.start(episodes, max_iter, seed)
        except (ValueError, TypeError) as exc:
            return JSONResponse({"error": str(exc)}, status_code=400)
        return JSONResponse(run.summary(), status_code=201, headers={"Location": f"/runs/{run.id}"})

    async def list_runs(self, request: Request) -> Response:
        return JSONResponse([r.summary() for r in self.runs.values()])

    def _get(self, request: Request) -> Run | None:
        return self.runs.get(request.path_params["run_id"])

    async def get_run(self, request: Request) -> Response:
        run = self._get(request)
        if run is None:
            return JSONResponse({"error": "no such run"}, status_code=404)
        return JSONResponse(run.summary())

    async def cancel_run(self, request: Request) -> Response:
        run = self._get(request)
        if run is None:
            return JSONResponse({"error": "no such run"}, status_code=404)
        run.scope.cancel()
        await run.over.wait()  # the run's task stops its workers, then records it
        return JSONResponse(run.summary())

    async def events(self, request: Request) -> Response:
        run = self._get(request)
        if run is None:
            return JSONResponse({"error": "no such run"}, status_code=404)

        async def sse() -> AsyncIterator[bytes]:
            sent = 0
            while True:
                # Whatever came since this viewer's last write goes in one write. Woken with
                # nothing new: a comment, so proxies and clients keep the idle stream.
                pending = run.log[sent:]
                sent += len(pending)
                yield b"".join(pending) if pending else b": keep-alive\n\n"
                if run.done and sent == len(run.log):  # its log ends with `end`, sent
                    return
                await run.wait()

        return _EventStream(run, sse())

    async def health(self, request: Request) -> Response:
        return JSONResponse({"ok": True, "runs": len(self.runs), "workers": self.workers})


class _EventStream(StreamingResponse):
    """A run's server-sent events; counted in its ``viewers`` while the connection is open."""

    def __init__(self, run: Run, body: AsyncIterator[bytes]) -> None:
        super().__init__(
            body,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self.run = run

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        self.run.viewers += 1
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.run.viewers -= 1


def _int(value: Any, name: str, minimum: int, maximum: int | None = None) -> int:
    bad = isinstance(value, bool) or not isinstance(value, int) or value < minimum
    if bad or (maximum is not None and value > maximum):
        bounds = f">= {minimum}" if maximum is None else f"from {minimum} to {maximum}"
        raise ValueError(f"`{name}` must be an integer {bounds}, got {value!r}")
    return value


def create_app(
    agent: Any = "DoNothingAgent",
    workers: int = 2,
    env_factory: Callable[[], Any] = make_env,
) -> Starlette:
    """The app; ``agent`` is a ``grid2op.Agent`` class name or anything ``AsyncRunner`` takes."""
    if isinstance(agent, str):
        agent = load_agent(agent)
    dash = Dashboard(env_factory, agent, workers)
    app = Starlette(
        routes=[
            Route("/", dash.page),
            Route("/health", dash.health),
            Route("/runs", dash.create_run, methods=["POST"]),
            Route("/runs", dash.list_runs, methods=["GET"]),
            Route("/runs/{run_id}", dash.get_run, methods=["GET"]),
            Route("/runs/{run_id}", dash.cancel_run, methods=["DELETE"]),
            Route("/runs/{run_id}/events", dash.events),
        ],
        lifespan=dash.lifespan,
    )
    app.state.dashboard = dash
    return app


PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>asyncrunner: live evaluation</title>
<style>
body{font-family:sans-serif;margin:1.5em;max-width:60em}
table{border-collapse:collapse;margin:1em 0}td,th{padding:.2em .6em;border-bottom:1px solid #ddd;text-align:left}
progress{width:12em}#chart{border:1px solid #ccc;background:#fafafa}
.finished{color:#070}.failed,.cancelled{color:#b00}
</style></head><body>
<h1>asyncrunner: live evaluation</h1>
<form id="form">episodes <input id="episodes" type="number" value="2" min="1" size="4">
max_iter <input id="max_iter" type="number" value="100" min="1" size="6">
seed <input id="seed" type="number" value="0" min="0" size="6">
<button>Start a run</button> <button type="button" id="cancel" disabled>Cancel</button></form>
<p>Run <b id="run-id">-</b>: <b id="status">idle</b>,
episodes done <b id="episodes-done">0/0</b>, steps <b id="steps">0</b></p>
<table><thead><tr><th>#</th><th>chronic</th><th>progress</th><th>steps</th><th>reward</th><th>state</th></tr></thead>
<tbody id="episodes-table"></tbody></table>
<svg id="chart" width="720" height="300" viewBox="0 0 720 300"></svg>
<p id="results"></p>
<script>
"use strict";
const $ = id => document.getElementById(id);
const colors = ["#1f77b4","#ff7f0e","#2ca02c","#d62728","#9467bd","#8c564b","#e377c2","#7f7f7f"];
let source = null, run = null, series = {}, eps = {}, total = 0, drawPending = false;
function row(i) {
  let tr = $("ep-" + i);
  if (!tr) {
    tr = document.createElement("tr"); tr.id = "ep-" + i;
    tr.innerHTML = "<td>"+i+"</td><td class=name></td><td><progress max=1 value=0></progress></td>" +
      "<td class=steps></td><td class=reward></td><td class=state></td>";
    $("episodes-table").appendChild(tr);
  }
  return tr;
}
function show(i) {
  const e = eps[i], tr = row(i);
  tr.querySelector(".name").textContent = e.name || "";
  const bar = tr.querySelector("progress"); bar.max = e.max_ts || 1; bar.value = e.steps || 0;
  tr.querySelector(".steps").textContent = (e.steps || 0) + "/" + (e.max_ts || "?");
  tr.querySelector(".reward").textContent = (e.cum_reward || 0).toFixed(2);
  tr.querySelector(".state").textContent = e.state; tr.querySelector(".state").className = "state " + e.state;
}
function summary() {
  const done = Object.values(eps).filter(e => e.state === "finished" || e.state === "failed").length;
  $("episodes-done").textContent = done + "/" + total;
  $("steps").textContent = Object.values(eps).reduce((s, e) => s + (e.steps || 0), 0);
}
function ticks(lo, hi, n) {  // about n round values from lo to hi
  const raw = ((hi - lo) || 1) / n, mag = Math.pow(10, Math.floor(Math.log10(raw)));
  const step = [1, 2, 5, 10].map(f => f * mag).find(s => s >= raw), out = [];
  for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) out.push(+v.toPrecision(12));
  return out;
}
function draw() {
  drawPending = false;
  // Plot area inside margins: tick labels on the left and bottom, the legend on the right.
  const svg = $("chart"), W = 720, H = 300, L = 60, R = 170, T = 15, B = 45;
  let maxX = 1, minY = 0, maxY = 1;
  for (const k in series) for (const [x, y] of series[k]) {
    maxX = Math.max(maxX, x); minY = Math.min(minY, y); maxY = Math.max(maxY, y);
  }
  const sx = x => L + (W - L - R) * x / maxX, sy = y => H - B - (H - T - B) * (y - minY) / ((maxY - minY) || 1);
  let out = '<line x1="'+L+'" y1="'+(H-B)+'" x2="'+(W-R)+'" y2="'+(H-B)+'" stroke="#999"/>' +
    '<line x1="'+L+'" y1="'+T+'" x2="'+L+'" y2="'+(H-B)+'" stroke="#999"/>';
  for (const x of ticks(0, maxX, 6)) {
    out += '<line x1="'+sx(x)+'" y1="'+(H-B)+'" x2="'+sx(x)+'" y2="'+(H-B+5)+'" stroke="#999"/>' +
      '<text x="'+sx(x)+'" y="'+(H-B+18)+'" text-anchor="middle" font-size="11">'+x+'</text>';
  }
  for (const y of ticks(minY, maxY, 5)) {
    out += '<line x1="'+(L-5)+'" y1="'+sy(y)+'" x2="'+(W-R)+'" y2="'+sy(y)+'" stroke="#e4e4e4"/>' +
      '<text x="'+(L-8)+'" y="'+(sy(y)+4)+'" text-anchor="end" font-size="11">'+y+'</text>';
  }
  out += '<text x="'+((L+W-R)/2)+'" y="'+(H-8)+'" text-anchor="middle" font-size="12">step</text>' +
    '<text transform="translate(14,'+((T+H-B)/2)+') rotate(-90)" text-anchor="middle" font-size="12">cumulative reward</text>';
  Object.keys(series).forEach((k, n) => {
    const pts = series[k], color = colors[k % colors.length], ly = T + 8 + 18 * n;
    out += '<line x1="'+(W-R+15)+'" y1="'+ly+'" x2="'+(W-R+35)+'" y2="'+ly+'" stroke-width="2" stroke="'+color+'"/>' +
      '<text x="'+(W-R+40)+'" y="'+(ly+4)+'" font-size="12">episode '+k+(eps[k] && eps[k].name ? " ("+eps[k].name+")" : "")+'</text>';
    if (!pts.length) return;
    const step = Math.max(1, Math.floor(pts.length / 400));
    let d = "";
    for (let j = 0; j < pts.length; j += step) d += (d ? "L" : "M") + sx(pts[j][0]).toFixed(1) + "," + sy(pts[j][1]).toFixed(1);
    const last = pts[pts.length - 1];
    d += "L" + sx(last[0]).toFixed(1) + "," + sy(last[1]).toFixed(1);
    out += '<path d="'+d+'" fill="none" stroke-width="1.5" stroke="'+color+'"/>';
  });
  svg.innerHTML = out;
}
function redraw() { if (!drawPending) { drawPending = true; requestAnimationFrame(draw); } }
function follow(id) {
  if (source) source.close();
  run = id; series = {}; eps = {}; $("episodes-table").innerHTML = ""; $("results").textContent = "";
  $("run-id").textContent = id; $("status").textContent = "running"; $("cancel").disabled = false;
  history.replaceState(null, "", "?run=" + id);
  source = new EventSource("runs/" + id + "/events");
  source.addEventListener("run", ev => { const d = JSON.parse(ev.data); total = d.episodes; summary(); });
  source.addEventListener("episode_started", ev => {
    const d = JSON.parse(ev.data); eps[d.index] = d; series[d.index] = [[0, 0]]; show(d.index); summary(); redraw();
  });
  source.addEventListener("steps", ev => {
    const d = JSON.parse(ev.data), e = eps[d.index], pts = series[d.index];
    let acc = pts.length ? pts[pts.length - 1][1] : 0;
    d.rewards.forEach((r, j) => { acc += (r || 0); pts.push([d.first_step + j, acc]); });
    e.steps = d.steps; e.cum_reward = d.cum_reward; show(d.index); summary(); redraw();
  });
  source.addEventListener("episode_finished", ev => {
    const d = JSON.parse(ev.data), e = eps[d.index];
    e.state = "finished"; e.steps = d.nb_time_step; e.cum_reward = d.cum_reward; show(d.index); summary(); redraw();
  });
  source.addEventListener("episode_failed", ev => {
    const d = JSON.parse(ev.data), e = eps[d.index] || (eps[d.index] = {index: d.index});
    e.state = d.retrying ? "retrying" : "failed"; show(d.index); summary();
  });
  source.addEventListener("end", ev => {
    const d = JSON.parse(ev.data); source.close(); source = null;
    $("status").textContent = d.state; $("status").className = d.state; $("cancel").disabled = true;
    if (d.state === "cancelled") for (const i in eps) {  // stopped with the run
      if (eps[i].state === "running" || eps[i].state === "retrying") { eps[i].state = "cancelled"; show(i); }
    }
    if (d.results) $("results").textContent = "mean reward " +
      (d.results.reduce((s, r) => s + r.cum_reward, 0) / Math.max(1, d.results.length)).toFixed(2);
    summary(); draw();
  });
}
$("form").addEventListener("submit", async ev => {
  ev.preventDefault();
  const body = {episodes: +$("episodes").value, max_iter: $("max_iter").value ? +$("max_iter").value : null,
                seed: $("seed").value ? +$("seed").value : null};
  const r = await fetch("runs", {method: "POST", headers: {"content-type": "application/json"}, body: JSON.stringify(body)});
  const d = await r.json();
  if (!r.ok) { $("status").textContent = d.error; return; }
  total = d.episodes; follow(d.id);
});
$("cancel").addEventListener("click", () => { if (run) fetch("runs/" + run, {method: "DELETE"}); });
const wanted = new URLSearchParams(location.search).get("run");
if (wanted) follow(wanted);
</script></body></html>
"""


app = create_app(
    agent=os.environ.get("ASYNCRUNNER_AGENT", "DoNothingAgent"),
    workers=int(os.environ.get("ASYNCRUNNER_WORKERS", "2")),
)


def main() -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--workers", type=int, default=2, help="episodes played at once")
    parser.add_argument("--agent", default="DoNothingAgent", help="a grid2op.Agent class name")
    args = parser.parse_args()
    # uvicorn shuts the app down (its runs cancelled, the runner closed) once every connection
    # closed: a viewer's event stream closes when its run ends, so a stop (SIGTERM, Ctrl-C) would
    # wait for the run. Three seconds, then the connections are cancelled.
    uvicorn.run(
        create_app(args.agent, args.workers),
        host=args.host,
        port=args.port,
        timeout_graceful_shutdown=SHUTDOWN_GRACE,
    )


if __name__ == "__main__":
    main()
