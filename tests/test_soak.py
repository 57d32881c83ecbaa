"""Many short episodes: the parent's memory does not grow with the number of episodes."""

from __future__ import annotations

from typing import Any

import pytest
from grid2op.Agent import RandomAgent

from asyncrunner import AsyncRunner

pytestmark = [pytest.mark.anyio, pytest.mark.slow]  # 600 episodes


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS in /proc/self/status")


async def test_500_short_episodes_keep_parent_memory_flat(env: Any, tmp_path: Any) -> None:
    # RandomAgent games end in a game over within a few steps: 500 episodes, mostly overhead.
    seeds = list(range(500))
    async with AsyncRunner(env, agent=RandomAgent, workers=2) as runner:
        await runner.run(
            100, env_seeds=seeds[:100], agent_seeds=seeds[:100], path_save=tmp_path / "a"
        )
        before = rss_mib()
        results = await runner.run(
            500, env_seeds=seeds, agent_seeds=seeds, path_save=tmp_path / "b"
        )
        after = rss_mib()
    assert len(results) == 500 and all(r.error is None for r in results)
    assert len(list((tmp_path / "b").iterdir())) == 500 + 4  # episodes + the four space files
    print(f"parent RSS before {before:.1f} MiB, after 500 episodes {after:.1f} MiB")
    assert after - before < 50
