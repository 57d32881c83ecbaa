"""An async agent that asks a policy service over HTTP, played from the orchestrator.

    pip install -e ".[lightsim,web]"    # httpx
    python examples/async_http_agent.py [--episodes 8] [--max-iter 50] [--delay 0.02]

The script starts a tiny policy service on 127.0.0.1 (stdlib ``http.server`` in a thread; each
answer takes ``--delay`` seconds, like a model server or an LLM would). ``HttpAgent.act`` is
``async``: it posts the observation's line loadings with httpx and awaits the answer, so the
episodes of every worker wait on the service at the same time. For comparison, the same policy
runs in the workers as a plain agent (``RuleAgent``): same seeds, same results.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
from grid2op.Agent import BaseAgent

from asyncrunner import AsyncRunner, CentralAgent


def choose(rho: Sequence[float]) -> int:
    """The policy: 1 (change the topology of substation 1) when a line is nearly full, else 0."""
    return int(max(rho) > 0.9)


def action_set(action_space: Any) -> list[Any]:
    return [action_space({}), action_space.get_all_unitary_topologies_set(action_space, 1)[3]]


class RuleAgent(BaseAgent):  # type: ignore[misc]  # grid2op is untyped
    """The policy played in each worker."""

    def __init__(self, action_space: Any) -> None:
        super().__init__(action_space)
        self.actions = action_set(action_space)

    def act(self, observation: Any, reward: float, done: bool = False) -> Any:
        return self.actions[choose(observation.rho.tolist())]


class HttpAgent:
    """The same policy behind HTTP: ``act`` is a coroutine, awaited on the runner's event loop."""

    def __init__(self, action_space: Any, client: httpx.AsyncClient) -> None:
        self.actions = action_set(action_space)
        self.client = client

    async def act(self, observation: Any, reward: float, done: bool) -> Any:
        response = await self.client.post("/act", json={"rho": observation.rho.tolist()})
        response.raise_for_status()
        return self.actions[response.json()["action"]]


@contextmanager
def policy_service(delay: float) -> Iterator[str]:
    """Serve ``choose`` on 127.0.0.1 (a free port) until the block exits; yields its URL."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            time.sleep(delay)  # the model's thinking time
            answer = json.dumps({"action": choose(body["rho"])}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


async def main(args: argparse.Namespace) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import grid2op

        try:
            from lightsim2grid import LightSimBackend

            env = grid2op.make("l2rpn_case14_sandbox", test=True, backend=LightSimBackend())
        except ImportError:
            env = grid2op.make("l2rpn_case14_sandbox", test=True)
    n = args.episodes
    kwargs: dict[str, Any] = dict(nb_episode=n, max_iter=args.max_iter, env_seeds=list(range(n)))

    async with AsyncRunner(env, agent=RuleAgent, workers=args.workers) as runner:
        local = [r.as_tuple()[1:4] for r in await runner.run(**kwargs)]

    limits = httpx.Limits(max_connections=n)
    with policy_service(args.delay) as url:
        async with httpx.AsyncClient(base_url=url, limits=limits) as client:
            central = CentralAgent(
                HttpAgent(env.action_space, client), envs_per_worker=args.envs_per_worker
            )
            async with AsyncRunner(env, agent=central, workers=args.workers) as runner:
                await runner.run(args.workers * args.envs_per_worker, max_iter=1)  # envs built
                start = time.perf_counter()
                results = await runner.run(**kwargs)
                elapsed = time.perf_counter() - start
    remote = [r.as_tuple()[1:4] for r in results]
    for name, reward, steps in remote:
        print(f"{name}: {steps} steps, reward {reward:.1f}")
    calls = sum(r.nb_time_step for r in results)
    print(
        f"{calls} calls of {args.delay * 1000:.0f} ms in {elapsed:.2f} s "
        f"({calls * args.delay:.2f} s if they waited one after the other)"
    )
    print(f"same results: {local == remote}")
    env.close()


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=8)
    parser.add_argument("--max-iter", type=int, default=50)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--envs-per-worker", type=int, default=4)
    parser.add_argument("--delay", type=float, default=0.02)
    return parser.parse_args(argv)


if __name__ == "__main__":
    asyncio.run(main(parse()))
