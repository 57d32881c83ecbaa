"""A worker's cache of chronics files (``_engine._chronics``): a chronic played again is not parsed
again, and gives the same frames, so the same episode."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pandas
import pytest

from asyncrunner._engine import _chronics
from tests.conftest import make_env


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The files pandas really parses (the cache's misses)."""
    parsed: list[str] = []
    original = pandas.read_csv

    def read_csv(path: Any, *args: Any, **kwargs: Any) -> Any:
        parsed.append(str(path))
        return original(path, *args, **kwargs)

    monkeypatch.setattr(pandas, "read_csv", read_csv)
    monkeypatch.setattr(_chronics, "_frames", type(_chronics._frames)())
    monkeypatch.setattr(_chronics, "_size", 0)
    return parsed


def _reset(env: Any, chronic: int, seed: int) -> Any:
    with _chronics.reading_chronics():
        return env.reset(seed=seed, options={"time serie id": chronic})


def test_a_chronic_reset_again_is_served_from_memory_with_the_same_episode(
    reads: list[str],
) -> None:
    env = make_env("rte_case14_opponent")
    try:
        first = _reset(env, 0, 1)
        first_steps = [env.step(env.action_space())[0].to_vect() for _ in range(3)]
        parsed = len(reads)
        assert parsed > 0
        _reset(env, 1, 2)  # another chronic: parsed
        assert len(reads) > parsed
        parsed = len(reads)
        again = _reset(env, 0, 1)  # the first again: not parsed
        assert len(reads) == parsed
        np.testing.assert_array_equal(again.to_vect(), first.to_vect())
        steps = [env.step(env.action_space())[0].to_vect() for _ in range(3)]
        for a, b in zip(steps, first_steps, strict=True):
            np.testing.assert_array_equal(a, b)
    finally:
        env.close()
    assert pandas.read_csv is not _chronics._read_csv  # restored after each reset


def test_served_frames_are_copies_and_a_changed_file_is_read_again(
    reads: list[str], tmp_path: Path
) -> None:
    data = tmp_path / "load_p.csv"
    data.write_text("a;b\n1.5;2\n3.25;4\n")
    with _chronics.reading_chronics():
        first = pandas.read_csv(data, sep=";")
        first.iloc[0, 0] = 99.0  # the caller's frame is its own
        second = pandas.read_csv(data, sep=";")
        assert len(reads) == 1
        assert second.iloc[0, 0] == 1.5 and list(second.dtypes) == [np.float64, np.int64]
        second.iloc[0, 0] = -1.0
        assert pandas.read_csv(data, sep=";").iloc[0, 0] == 1.5
        pandas.read_csv(data, sep=",")  # other arguments: read
        assert len(reads) == 2
        shutil.copy(data, tmp_path / "copy.csv")
        data.write_text("a;b\n7;8\n")  # changed (size): read again
        assert pandas.read_csv(data, sep=";").iloc[0, 0] == 7
        assert len(reads) == 3
        with open(tmp_path / "copy.csv") as f:  # a buffer: always read
            pandas.read_csv(f, sep=";")
        assert len(reads) == 4
    assert pandas.read_csv is not _chronics._read_csv
