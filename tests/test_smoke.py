from __future__ import annotations

from typing import Any

import pytest
from grid2op.Agent import DoNothingAgent

from asyncrunner import AsyncRunner

pytestmark = pytest.mark.anyio


async def test_run_returns_results_in_request_order(env: Any) -> None:
    async with AsyncRunner(env, agent=DoNothingAgent, workers=2) as runner:
        results = await runner.run(3, max_iter=5, episode_id=[2, 0, 1])
    assert [r.index for r in results] == [0, 1, 2]
    assert [r.name for r in results] == ["0002", "0000", "0001"]
    assert all(r.nb_time_step == 5 and r.error is None for r in results)
