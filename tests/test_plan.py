"""Run arguments are checked before any work, with messages that say what to do."""

from __future__ import annotations

import errno
import os
import tempfile
from typing import Any

import pytest

from asyncrunner._plan._arguments import check_path_save, plan_episodes

NAMES = ["0000", "0001", "0002"]


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (dict(nb_episode=1.5), TypeError, "`nb_episode` must be an integer"),
        (dict(nb_episode=-1), ValueError, "`nb_episode` must be >= 0"),
        (dict(max_iter="10"), TypeError, "`max_iter` must be an integer or None"),
        (dict(max_iter=0), ValueError, r"or -1 for no limit"),
        (dict(env_seeds=7), TypeError, "one entry per episode, got int"),
        (dict(env_seeds="12"), TypeError, "one entry per episode, got str"),
        (dict(agent_seeds=[1]), ValueError, "has 1 entries but nb_episode=2"),
        (dict(env_seeds=[1, "x"]), TypeError, "entries must be integers"),
        (dict(env_seeds=[1, -2]), ValueError, "non-negative integers, got -2"),
        (dict(init_states=[{}, 3]), TypeError, "dicts or grid2op actions, got 3"),
        (dict(reset_options=[{}, "x"]), TypeError, "entries must be dicts"),
        (dict(reset_options={"seed": 1}), ValueError, r"unknown keys \['seed'\]"),
        (dict(episode_id=["0000", "nope"]), ValueError, "'nope' is not a chronic"),
        (dict(episode_id=[0, 1.5j]), TypeError, "integers or chronic names"),
        (dict(episode_id=[["x", 0], 1]), TypeError, r"\(\(mix, id\) pairs are tuples\)"),
        (dict(reset_options={"time serie id": float("inf")}), ValueError, "read with int"),
        (dict(episode_id=[0, 3]), ValueError, r"this env has 3 chronics, ids 0 to 2 \(or give"),
        (dict(episode_id=[0, -1]), ValueError, "out of range: ids start at 0"),
    ],
)
def test_bad_arguments(kwargs: dict[str, Any], error: type[Exception], message: str) -> None:
    kwargs = {"nb_episode": 2, **kwargs}
    with pytest.raises(error, match=message):
        plan_episodes(names=NAMES, **kwargs)


def test_requests_follow_grid2op_conventions() -> None:
    with pytest.warns(UserWarning, match="ignore the `max step` of the `reset_options`"):
        requests = plan_episodes(
            4,
            names=NAMES,
            max_iter=-1,
            env_seeds=[1, 2, 3, 4],
            reset_options={"time serie id": 2, "max step": 7},
        )
    # -1 stays -1 (grid2op resets with "max step": -1: no limit, and max_episode_duration() -1,
    # where no max_iter leaves the chronic's); "time serie id" in reset_options picks the chronic
    # when no id is given; max_iter wins over "max step", as in grid2op's Runner.
    assert [(r.episode_id, r.max_iter, r.env_seed) for r in requests] == [
        (2, -1, 1),
        (2, -1, 2),
        (2, -1, 3),
        (2, -1, 4),
    ]
    assert requests[0].reset_options == {}
    # What grid2op's Runner overrides is not checked: an invalid value was refused (found by a
    # hunt), grid2op plays the episode.
    with (
        pytest.warns(UserWarning, match="ignore the `init state`"),
        pytest.warns(UserWarning, match="ignore the `max step`"),
    ):
        (request,) = plan_episodes(
            1,
            names=NAMES,
            max_iter=3,
            init_states={"set_line_status": [(0, -1)]},
            reset_options={"max step": 0, "init state": {"no such key": 1}},
        )
    assert (request.max_iter, request.reset_options) == (3, {})
    with pytest.warns(UserWarning, match="ignore the `time serie id`"):  # (it gave none)
        (request,) = plan_episodes(
            1, names=NAMES, episode_id=[1], reset_options={"time serie id": 2}
        )
    assert (request.episode_id, request.reset_options) == (1, {})
    plain = plan_episodes(4, names=NAMES, episode_id=None)
    assert [r.episode_id for r in plain] == [0, 1, 2, 0]  # chronics in turn, wrapping around
    named = plan_episodes(2, names=None, episode_id=["0001", 5])
    assert [r.episode_id for r in named] == ["0001", 5]  # no names to check against


def test_a_full_disk_says_to_free_space(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # "give a folder you can write to" sent the user looking at permissions.
    def full(*args: Any, **kwargs: Any) -> Any:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(tempfile, "mkstemp", full)
    with pytest.raises(ValueError, match=r"No space left on device.*free some space"):
        check_path_save(tmp_path)


def test_path_save_must_be_a_writable_folder(tmp_path: Any) -> None:
    file = tmp_path / "file"
    file.write_text("")
    with pytest.raises(ValueError, match="is a file"):
        check_path_save(file)
    with pytest.raises(ValueError, match="cannot be created"):
        check_path_save(file / "below")
    created = check_path_save(tmp_path / "new" / "runs")
    assert os.path.isdir(created) and os.path.isabs(created)
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(ValueError, match="is not writable"):
            check_path_save(locked)


def test_seeds_may_be_grid2op_s_largest() -> None:
    # grid2op's Runner plays env seed 2**31 - 1 and agent seed 2**32 - 1 (the audit's boundary).
    (request,) = plan_episodes(1, names=NAMES, env_seeds=[2**31 - 1], agent_seeds=[2**32 - 1])
    assert (request.env_seed, request.agent_seed) == (2**31 - 1, 2**32 - 1)
    with pytest.raises(ValueError, match="must be at most 2147483647"):
        plan_episodes(1, names=NAMES, env_seeds=[2**31])


def test_ids_of_an_env_shuffled_since_make_name_the_chronics_a_build_plays() -> None:
    # grid2op's Runner and the workers play an env built from its params: a shuffle does not
    # travel (resume matched an id to the shuffled env's chronic: another episode's result).
    from asyncrunner._plan._arguments import chronic_names

    from .conftest import make_env

    env = make_env()
    try:
        names = chronic_names(env)
        assert names is not None and len(names) > 1
        env.chronics_handler.shuffle(lambda order: order[::-1])
        assert chronic_names(env) == names
        assert chronic_names(env, as_built=False) == names[::-1]
    finally:
        env.close()
