"""Play episodes from a plain script: ``python examples/run_script.py [--max-iter N]``.

Where worker processes are fresh interpreters (not Linux's default fork) they re-run this file as
``__mp_main__``, so everything that runs episodes sits under ``if __name__ == "__main__":``.
"""

from __future__ import annotations

import argparse
import asyncio

import grid2op
from grid2op.Agent import DoNothingAgent

from asyncrunner import AsyncRunner, EpisodeResult


def make_env() -> grid2op.Environment.Environment:
    try:
        from lightsim2grid import LightSimBackend
    except ImportError:
        return grid2op.make("l2rpn_case14_sandbox", test=True)
    return grid2op.make("l2rpn_case14_sandbox", test=True, backend=LightSimBackend())


async def evaluate(episodes: int, workers: int, max_iter: int | None) -> list[EpisodeResult]:
    env = make_env()
    try:
        async with AsyncRunner(env, agent=DoNothingAgent, workers=workers) as runner:
            return await runner.run(episodes, max_iter=max_iter)
    finally:
        env.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--max-iter", type=int, default=None)
    args = parser.parse_args()
    results = asyncio.run(evaluate(args.episodes, args.workers, args.max_iter))
    for r in results:
        print(
            f"episode {r.index}: chronic {r.name}, {r.nb_time_step}/{r.max_ts} steps, "
            f"reward {r.cum_reward:.2f}"
        )


if __name__ == "__main__":
    main()
