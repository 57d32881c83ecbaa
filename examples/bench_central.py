"""Steps/s of agents in the workers vs in the orchestrator (``CentralAgent``), one invocation.

    python examples/bench_central.py [--episodes 16] [--max-iter 50] [--workers 2]
                                     [--envs-per-worker 8] [--batch-sizes 1,4,16] [--hidden 64]

1. The numpy MLP of ``central_mlp.py``: copied into each worker, then batched in the
   orchestrator at several maximum batch sizes (``vectors=True``).
2. An agent whose every call waits ``--delay`` seconds: in each worker as a sync agent
   (``time.sleep``), then in the orchestrator as an async agent (``anyio.sleep``).

Every configuration runs once to start its workers and build their envs, then once timed.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
import warnings
from collections.abc import Sequence
from typing import Any

import anyio
from grid2op.Agent import BaseAgent

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # workers run this file too
from central_mlp import MLPAgent

from asyncrunner import AsyncRunner, CentralAgent


class SleepAgent(BaseAgent):  # type: ignore[misc]  # grid2op is untyped
    """Waits ``delay`` seconds per call (a remote service, called synchronously), does nothing."""

    def __init__(self, action_space: Any, delay: float = 0.02) -> None:
        super().__init__(action_space)
        self.delay = delay

    def act(self, observation: Any, reward: float, done: bool = False) -> Any:
        time.sleep(self.delay)
        return self.action_space({})


class AsyncSleepAgent(SleepAgent):
    """The same agent, awaiting its wait."""

    async def act(self, observation: Any, reward: float, done: bool = False) -> Any:  # type: ignore[override]  # async on purpose
        await anyio.sleep(self.delay)
        return self.action_space({})


async def rates(
    env: Any, agent: Any, workers: int, in_flight: int, sizes: Sequence[int] = (0,), **kwargs: Any
) -> list[tuple[float, float]]:
    """Steps/s and mean batch of a timed run per maximum batch size, on one runner.

    A first run starts the workers and builds their envs.
    """
    out = []
    async with AsyncRunner(env, agent=agent, workers=workers) as runner:
        await runner.run(in_flight, max_iter=1)
        for size in sizes:
            if isinstance(agent, CentralAgent):
                agent.max_batch = size
                agent.batch_sizes.clear()
            start = time.perf_counter()
            results = await runner.run(**kwargs)
            elapsed = time.perf_counter() - start
            mean = mean_batch(agent) if isinstance(agent, CentralAgent) else 1.0
            out.append((sum(r.nb_time_step for r in results) / elapsed, mean))
    return out


def mean_batch(central: CentralAgent) -> float:
    count = sum(central.batch_sizes.values())
    return sum(k * v for k, v in central.batch_sizes.items()) / max(count, 1)


async def main(args: argparse.Namespace) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import grid2op
        from lightsim2grid import LightSimBackend

        env = grid2op.make("l2rpn_case14_sandbox", test=True, backend=LightSimBackend())
    n, w, k = args.episodes, args.workers, args.envs_per_worker
    kwargs: dict[str, Any] = dict(nb_episode=n, max_iter=args.max_iter, env_seeds=list(range(n)))
    print(f"{n} episodes x max_iter {args.max_iter}, {w} worker processes, {os.cpu_count()} CPUs")

    mlp = MLPAgent(env.action_space, hidden=args.hidden)
    ((base, _),) = await rates(env, mlp, w, w, **kwargs)
    print(f"MLP (hidden {args.hidden}) in each worker: {base:8,.0f} steps/s")
    central = CentralAgent(mlp, vectors=True, envs_per_worker=k)
    for size, (steps, mean) in zip(
        args.batch_sizes,
        await rates(env, central, w, w * k, args.batch_sizes, **kwargs),
        strict=True,
    ):
        print(
            f"MLP in the orchestrator, max_batch {size:3d}, {k} envs/worker: {steps:8,.0f} steps/s "
            f"({steps / base:.2f}x; mean batch {mean:.1f})"
        )

    ms = args.delay * 1000
    ((sync, _),) = await rates(env, SleepAgent(env.action_space, args.delay), w, w, **kwargs)
    print(f"{ms:.0f} ms sync agent in each worker: {sync:8,.0f} steps/s")
    agent = AsyncSleepAgent(env.action_space, args.delay)
    central = CentralAgent(agent, vectors=True, envs_per_worker=k)
    ((steps, _),) = await rates(env, central, w, w * k, [32], **kwargs)
    print(
        f"{ms:.0f} ms async agent in the orchestrator, {k} envs/worker: {steps:8,.0f} steps/s "
        f"({steps / sync:.2f}x)"
    )
    env.close()


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=16)
    parser.add_argument("--max-iter", type=int, default=50)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--envs-per-worker", type=int, default=8)
    parser.add_argument(
        "--batch-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 16]
    )
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--delay", type=float, default=0.02)
    return parser.parse_args(argv)


if __name__ == "__main__":
    asyncio.run(main(parse()))
