"""``asyncrunner show DIR``: summarise a saved run (grid2op EpisodeData folders, ours or grid2op
Runner's): per episode the chronic, steps played / max, cumulative reward, agent time and whether
it ended in a game over; ``--plot FILE.png`` draws survival and cumulative reward over time."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import numpy as np

__all__ = ["EpisodeSummary", "main", "read_run"]


@dataclass(frozen=True)
class EpisodeSummary:
    """What ``show`` prints for one saved episode folder."""

    folder: str
    chronic: str
    steps: int
    max_steps: int
    cum_reward: float
    agent_time: float | None

    @property
    def game_over(self) -> bool:
        return self.steps < self.max_steps


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\nTry '{self.prog} --help'.\n")


def _parser() -> _Parser:
    parser = _Parser(
        prog="asyncrunner show",
        description=(
            "Summarise a saved run: a folder of grid2op EpisodeData episodes (asyncrunner run "
            "--save, path_save=, or grid2op's own Runner)."
        ),
    )
    parser.add_argument("dir", metavar="DIR", help="the folder the run was saved in")
    parser.add_argument(
        "--plot",
        metavar="FILE.png",
        default=None,
        help="also draw survival and cumulative reward over time (needs matplotlib)",
    )
    return parser


def _episode_dirs(root: Path) -> list[Path]:
    return sorted(
        p
        for p in root.iterdir()
        if p.is_dir() and not p.name.startswith(".") and (p / "episode_meta.json").is_file()
    )


def _read_json(path: Path) -> Any:
    with path.open() as f:
        return json.load(f)


def read_run(root: Path) -> list[EpisodeSummary]:
    """The summaries of the complete episode folders directly under ``root``."""
    out = []
    for folder in _episode_dirs(root):
        meta = _read_json(folder / "episode_meta.json")
        agent_time: float | None = None
        times_file = folder / "episode_times.json"
        if times_file.is_file():
            agent = _read_json(times_file).get("Agent", {})
            if isinstance(agent, dict) and agent.get("total") is not None:
                agent_time = float(agent["total"])
        chronics_path = str(meta.get("chronics_path") or folder.name)
        out.append(
            EpisodeSummary(
                folder=folder.name,
                chronic=Path(chronics_path).name,
                steps=int(meta["nb_timestep_played"]),
                max_steps=int(meta["chronics_max_timestep"]),
                cum_reward=float(meta["cumulative_reward"]),
                agent_time=agent_time,
            )
        )
    return out


def _rewards(root: Path, summary: EpisodeSummary) -> np.ndarray:
    with np.load(root / summary.folder / "rewards.npz") as data:
        rewards: np.ndarray = np.asarray(data["data"], dtype=float)[: summary.steps]
    clean: np.ndarray = np.nan_to_num(rewards)
    return clean


def _print_table(episodes: Sequence[EpisodeSummary]) -> None:
    width = max([len("episode"), *(len(e.folder) for e in episodes)])
    print(
        f"{'episode':<{width}}  {'chronic':<10} {'steps/max':>12} {'cum reward':>12} "
        f"{'agent time':>11}  game over"
    )
    for e in episodes:
        steps = f"{e.steps}/{e.max_steps}"
        agent = "-" if e.agent_time is None else f"{e.agent_time:.3f} s"
        print(
            f"{e.folder:<{width}}  {e.chronic:<10} {steps:>12} {e.cum_reward:>12.2f} "
            f"{agent:>11}  {'yes' if e.game_over else 'no'}"
        )
    played = sum(e.steps for e in episodes)
    over = sum(e.game_over for e in episodes)
    mean = sum(e.cum_reward for e in episodes) / len(episodes)
    print(
        f"{len(episodes)} episodes, {played} steps, {over} game over, mean cumulative reward {mean:.2f}"
    )


def _plot(root: Path, episodes: Sequence[EpisodeSummary], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (survival, reward) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = [e.folder for e in episodes]
    survival.bar(names, [e.max_steps for e in episodes], color="lightgrey", label="chronic length")
    survival.bar(names, [e.steps for e in episodes], label="steps played")
    survival.set(xlabel="episode", ylabel="steps", title="Survival")
    survival.tick_params(axis="x", labelrotation=45)
    survival.legend()
    for e in episodes:
        rewards = _rewards(root, e)
        reward.plot(np.arange(1, len(rewards) + 1), np.cumsum(rewards), label=e.folder)
    reward.set(xlabel="step", ylabel="cumulative reward", title="Cumulative reward")
    if len(episodes) <= 12:
        reward.legend()
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


def main(argv: Sequence[str]) -> int:
    """``asyncrunner show DIR [--plot FILE.png]``; returns the exit status."""
    parser = _parser()
    args = parser.parse_args(list(argv))
    root = Path(args.dir)
    if not root.is_dir():
        parser.error(f"no such folder: {root}")
    plot = None
    if args.plot is not None:
        plot = Path(args.plot)
        if plot.suffix.lower() != ".png":
            parser.error(f"--plot writes a PNG file: give a name ending in .png, not {plot.name!r}")
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            parser.error('--plot needs matplotlib: pip install "asyncrunner[plot]"')
    try:
        episodes = read_run(root)
    except (OSError, ValueError, KeyError) as exc:
        print(f"asyncrunner show: cannot read {root}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    if not episodes:
        parser.error(f"no saved episode in {root} (folders with an episode_meta.json)")
    _print_table(episodes)
    if plot is not None:
        _plot(root, episodes, plot)
        print(f"plot written to {plot}")
    return 0
