"""``asyncrunner show DIR``: summarise a saved run (grid2op EpisodeData folders, ours or grid2op
Runner's): per episode the chronic, steps played / max, cumulative reward, agent time and whether
it ended in a game over; ``--plot FILE.png`` draws survival and cumulative reward over time.

Episodes saved by different runs in the same folder (a re-run adds ``<chronic>_1``, ...) are told
apart by the run id asyncrunner records in each episode folder (``asyncrunner.json``): the table
groups them by run, with a summary line per run."""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import numpy as np

from ._common import check_plot

__all__ = ["EpisodeSummary", "episode_dirs", "figure", "main", "read_run"]

# asyncrunner's record in each episode folder it saves (sinks._episode_data.RECORD_FILE).
_RECORD_FILE = "asyncrunner.json"


@dataclass(frozen=True)
class EpisodeSummary:
    """What ``show`` prints for one saved episode folder."""

    folder: str
    chronic: str
    steps: int
    max_steps: int
    cum_reward: float
    agent_time: float | None
    run: str | None = None  # the run that saved it (None: not saved by asyncrunner)
    index: int | None = None  # its index in that run's request

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
        type=os.path.expanduser,  # --plot=~/runs.png: the shell leaves "~" as it is
        default=None,
        help="also draw survival and cumulative reward over time (needs matplotlib)",
    )
    return parser


def episode_dirs(root: str | Path) -> list[Path]:
    """The complete episode folders directly under ``root`` (those with an episode_meta.json)."""
    root = Path(root)
    return sorted(
        p
        for p in root.iterdir()
        if p.is_dir() and not p.name.startswith(".") and (p / "episode_meta.json").is_file()
    )


def _saved_dirs(root: Path) -> list[Path]:
    """The episode folders of ``root``, or, when it has none, those of its subfolders: a
    multimix run's (one folder per mix) or a score's (one per agent and reference)."""
    found = episode_dirs(root)
    if found:
        return found
    subfolders = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    return [episode for sub in subfolders for episode in episode_dirs(sub)]


def note_earlier_episodes(save: str, prog: str) -> None:
    """Say when ``--save`` adds to a folder that already holds saved episodes (a score's or a
    multimix run's in its subfolders too)."""
    root = Path(save).absolute()
    earlier = _saved_dirs(root) if root.is_dir() else []
    if earlier:
        count = f"{len(earlier)} saved episode{'s' if len(earlier) != 1 else ''}"
        print(
            f"asyncrunner {prog}: {save} already holds {count} of an earlier {prog}; this one "
            "saves its own beside them (a chronic already there goes to <name>_1, ...). "
            "`asyncrunner show` tells the runs apart; --resume would play only the missing ones.",
            file=sys.stderr,
        )


def read_run(root: Path) -> list[EpisodeSummary]:
    """The summaries of the complete episode folders under ``root`` (``_saved_dirs``), run by
    run (earliest run first), each run in request order. A folder whose files cannot be read
    (a grid2op Runner killed as it wrote them) is left out with a warning naming it."""
    out = []
    saved_at: dict[str | None, float] = {}
    for folder in _saved_dirs(root):
        try:
            summary, mtime = _summary(root, folder)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            warnings.warn(
                f"{folder} left out: cannot read it ({type(exc).__name__}: {exc})", stacklevel=2
            )
            continue
        saved_at[summary.run] = min(saved_at.get(summary.run, mtime), mtime)
        out.append(summary)
    out.sort(
        key=lambda e: (saved_at[e.run], str(e.run), -1 if e.index is None else e.index, e.folder)
    )
    return out


def _summary(root: Path, folder: Path) -> tuple[EpisodeSummary, float]:
    """The summary of the episode saved in ``folder``, and when it was saved."""
    meta = _read_json(folder / "episode_meta.json")
    agent_time: float | None = None
    times_file = folder / "episode_times.json"
    if times_file.is_file():
        agent = _read_json(times_file).get("Agent", {})
        if isinstance(agent, dict) and agent.get("total") is not None:
            agent_time = float(agent["total"])
    chronics_path = str(meta.get("chronics_path") or folder.name)
    record: dict[str, Any] = {}
    if (folder / _RECORD_FILE).is_file():
        record = _read_json(folder / _RECORD_FILE)
    run = record.get("run_id")
    index = record.get("index")
    summary = EpisodeSummary(
        folder=folder.relative_to(root).as_posix(),
        chronic=Path(chronics_path).name,
        steps=int(meta["nb_timestep_played"]),
        max_steps=int(meta["chronics_max_timestep"]),
        cum_reward=float(meta["cumulative_reward"]),
        agent_time=agent_time,
        run=None if run is None else str(run),
        index=index if isinstance(index, int) else None,
    )
    return summary, (folder / "episode_meta.json").stat().st_mtime


def _read_json(path: Path) -> Any:
    try:
        with path.open() as f:
            return json.load(f)
    except ValueError as exc:
        raise ValueError(f"{path.name}: {exc}") from exc


def _rewards(root: Path, summary: EpisodeSummary) -> np.ndarray:
    with np.load(root / summary.folder / "rewards.npz") as data:
        rewards: np.ndarray = np.asarray(data["data"], dtype=float)[: summary.steps]
    clean: np.ndarray = np.nan_to_num(rewards)
    return clean


def _runs(episodes: Sequence[EpisodeSummary]) -> list[str | None]:
    return list(dict.fromkeys(e.run for e in episodes))


def _run_names(runs: Sequence[str | None]) -> dict[str | None, str]:
    """``run 1``, ``run 2``... for asyncrunner's runs in their order; what another tool saved
    (grid2op's Runner: no run record) is named so."""
    ours = [run for run in runs if run is not None]
    names: dict[str | None, str] = {run: f"run {n}" for n, run in enumerate(ours, 1)}
    names[None] = "saved by another tool"
    return names


def _totals(episodes: Sequence[EpisodeSummary]) -> str:
    played = sum(e.steps for e in episodes)
    over = sum(e.game_over for e in episodes)
    mean = sum(e.cum_reward for e in episodes) / len(episodes)
    return (
        f"{len(episodes)} episode{'s' if len(episodes) != 1 else ''}, {played} steps, "
        f"{over} game over, "
        f"mean cumulative reward {mean:.2f}"
    )


def _print_table(episodes: Sequence[EpisodeSummary]) -> None:
    width = max([len("episode"), *(len(e.folder) for e in episodes)])
    print(
        f"{'episode':<{width}}  {'chronic':<10} {'steps/max':>12} {'cum reward':>12} "
        f"{'agent time':>11}  game over"
    )
    runs = _runs(episodes)
    names = _run_names(runs)
    for run in runs:
        mine = [e for e in episodes if e.run == run]
        for e in mine:
            steps = f"{e.steps}/{e.max_steps}"
            agent = "-" if e.agent_time is None else f"{e.agent_time:.3f} s"
            print(
                f"{e.folder:<{width}}  {e.chronic:<10} {steps:>12} {e.cum_reward:>12.2f} "
                f"{agent:>11}  {'yes' if e.game_over else 'no'}"
            )
        if len(runs) > 1:
            name = names[run] if run is None else f"{names[run]} (id {run})"
            print(f"  {name}: {_totals(mine)}")
    if len(runs) > 1:
        print(f"{_totals(episodes)} ({len(runs)} runs in this folder: see each above)")
    else:
        print(_totals(episodes))


def _plot(root: Path, episodes: Sequence[EpisodeSummary], out: Path) -> None:
    import matplotlib.pyplot as plt

    fig = figure(root, episodes)
    fig.savefig(out)
    plt.close(fig)


def figure(root: Path, episodes: Sequence[EpisodeSummary]) -> Any:
    """The ``--plot`` figure: survival bars and cumulative reward lines (a matplotlib Figure)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = _runs(episodes)
    run_names = _run_names(runs)

    def label(e: EpisodeSummary) -> str:
        return e.folder if len(runs) == 1 else f"{e.folder} ({run_names[e.run]})"

    fig, (survival, reward) = plt.subplots(1, 2, figsize=(13, 4.8))
    names = [label(e) for e in episodes]
    # The episode's maximum: its chronic's length, or max_iter when the run gave one.
    survival.bar(names, [e.max_steps for e in episodes], color="lightgrey", label="max steps")
    survival.bar(names, [e.steps for e in episodes], label="steps played")
    survival.set(xlabel="episode", ylabel="steps", title="Survival")
    survival.tick_params(axis="x", labelrotation=45)
    # Headroom above the tallest bar for the legend, so it never covers a bar.
    survival.set_ylim(0, 1.25 * max(e.max_steps for e in episodes))
    survival.legend(loc="upper center", ncol=2)
    styles = ("-", "--", "-.", ":")
    n = len(episodes)
    for i, e in enumerate(episodes):
        rewards = _rewards(root, e)
        # Identical episodes draw the same line: each later one thinner and dashed differently,
        # on top of the earlier, so every one stays visible.
        reward.plot(
            np.arange(1, len(rewards) + 1),
            np.cumsum(rewards),
            label=label(e),
            linestyle=styles[i % len(styles)],
            linewidth=1.2 + 3.0 * (n - 1 - i) / max(n - 1, 1),
        )
    reward.set(xlabel="step", ylabel="cumulative reward", title="Cumulative reward")
    if n <= 12:
        reward.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    fig.tight_layout()
    return fig


def main(argv: Sequence[str]) -> int:
    """``asyncrunner show DIR [--plot FILE.png]``; returns the exit status."""
    parser = _parser()
    args = parser.parse_args(list(argv))
    root = Path(args.dir)
    if root.exists() and not root.is_dir():
        parser.error(f"{root} is a file, not a folder: give the folder a run was saved in")
    if not root.is_dir():
        parser.error(f"no such folder: {root}")
    plot = None
    if args.plot is not None:
        plot = Path(args.plot)
        check_plot(parser, plot)
    try:
        episodes = read_run(root)
    except (OSError, ValueError, KeyError) as exc:
        print(f"asyncrunner show: cannot read {root}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    if not episodes:
        if (root / "episode_meta.json").is_file():
            parser.error(
                f"{root} is one episode's folder: give the folder it was saved in "
                f"({root.resolve().parent})"
            )
        parser.error(
            f"no saved episode in {root} or its subfolders (folders with an episode_meta.json)"
        )
    _print_table(episodes)
    if plot is not None:
        _plot(root, episodes, plot)
        print(f"plot written to {plot}")
    return 0
