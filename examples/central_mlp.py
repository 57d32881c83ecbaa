"""A numpy MLP agent played two ways: copied into each worker, and batched in the orchestrator.

    python examples/central_mlp.py [--episodes 8] [--max-iter 50] [--workers 2] [--envs-per-worker 4]

The MLP (fixed weights) reads ``obs.to_vect()`` and picks one of a few topology actions. In the
orchestrator (``CentralAgent``) one instance answers every episode waiting at that moment with
one ``act_batch`` call (a 2-D array of observation vectors with ``vectors=True``): one model for
the whole run, as a GPU model would be. Both runs use the same seeds and give the same results.
"""

from __future__ import annotations

import argparse
import asyncio
import time
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
from grid2op.Agent import BaseAgent

from asyncrunner import AsyncRunner, CentralAgent


class MLPAgent(BaseAgent):  # type: ignore[misc]  # grid2op is untyped
    """A two-layer MLP with fixed weights over ``obs.to_vect()``; deterministic and stateless."""

    def __init__(self, action_space: Any, hidden: int = 64) -> None:
        super().__init__(action_space)
        topologies = action_space.get_all_unitary_topologies_set(action_space, sub_id=1)
        self.actions = [action_space({}), *topologies[:7]]
        self.hidden = hidden
        self.w1 = self.w2 = np.empty(0)

    def _weights(self, n: int) -> None:
        rng = np.random.default_rng(0)  # fixed: every copy of the agent has the same weights
        self.w1 = rng.normal(size=(n, self.hidden)) / np.sqrt(n)
        self.w2 = rng.normal(size=(self.hidden, len(self.actions)))
        self.w2[:, 0] += 2.0  # mostly "do nothing"

    def policy(self, x: np.ndarray) -> np.ndarray:
        """Action indices for a 2-D array of observation vectors."""
        if self.w1.size == 0:
            self._weights(x.shape[1])
        h = np.tanh(np.sin(x.astype(np.float64)) @ self.w1)
        return np.argmax(h @ self.w2, axis=1)  # type: ignore[no-any-return]  # numpy stubs

    def act(self, observation: Any, reward: float, done: bool = False) -> Any:
        return self.actions[int(self.policy(observation.to_vect()[None])[0])]

    def act_batch(self, observations: Any, rewards: Sequence[float], dones: Sequence[bool]) -> Any:
        x = (
            observations
            if isinstance(observations, np.ndarray)
            else np.stack([o.to_vect() for o in observations])
        )
        return [self.actions[int(i)] for i in self.policy(x)]


async def timed(runner: AsyncRunner, **kwargs: Any) -> tuple[list[Any], float]:
    """Results of one run and its steps per second."""
    start = time.perf_counter()
    results = await runner.run(**kwargs)
    steps = sum(r.nb_time_step for r in results)
    return [r.as_tuple()[1:4] for r in results], steps / (time.perf_counter() - start)


async def main(args: argparse.Namespace) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import grid2op

        try:
            from lightsim2grid import LightSimBackend

            env = grid2op.make("l2rpn_case14_sandbox", test=True, backend=LightSimBackend())
        except ImportError:
            env = grid2op.make("l2rpn_case14_sandbox", test=True)
    agent = MLPAgent(env.action_space)
    n = args.episodes
    kwargs: dict[str, Any] = dict(nb_episode=n, max_iter=args.max_iter, env_seeds=list(range(n)))

    async with AsyncRunner(env, agent=agent, workers=args.workers) as runner:
        await runner.run(args.workers, max_iter=1)  # workers started, envs built
        in_worker, rate_worker = await timed(runner, **kwargs)
    central = CentralAgent(
        agent, max_batch=args.max_batch, vectors=True, envs_per_worker=args.envs_per_worker
    )
    async with AsyncRunner(env, agent=central, workers=args.workers) as runner:
        await runner.run(args.workers * args.envs_per_worker, max_iter=1)
        central.batch_sizes.clear()
        in_orchestrator, rate_central = await timed(runner, **kwargs)
    # as_tuple()[1:4] is (name, cum_reward, nb_time_step), as grid2op's Runner orders them.
    for (name, reward, steps), other in zip(in_worker, in_orchestrator, strict=True):
        print(
            f"{name}: {steps} steps, reward {reward:.1f}  (orchestrator: {other[2]}, {other[1]:.1f})"
        )
    batches = sum(central.batch_sizes.values())
    mean = sum(k * v for k, v in central.batch_sizes.items()) / max(batches, 1)
    print(f"in each worker: {rate_worker:,.0f} steps/s")
    print(
        f"in the orchestrator: {rate_central:,.0f} steps/s, {batches} batches, mean size {mean:.1f}"
    )
    print(f"same results: {in_worker == in_orchestrator}")
    env.close()


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=8)
    parser.add_argument("--max-iter", type=int, default=50)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--envs-per-worker", type=int, default=4)
    parser.add_argument("--max-batch", type=int, default=32)
    return parser.parse_args(argv)


if __name__ == "__main__":
    asyncio.run(main(parse()))
