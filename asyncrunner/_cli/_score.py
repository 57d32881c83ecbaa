"""``asyncrunner score ENV --agent SPEC [--agent SPEC2 ...] --competition NAME``: grid2op's
competition score of one or more agents, side by side on the same scenarios and seeds.

Prints one row per scenario (each agent's score and steps survived) and the totals; ``--json``
prints the same as JSON; ``--plot FILE.png`` draws score per scenario and survival.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .._engine._parsed import parsing_once
from .._exceptions import EpisodeError
from .._score._scoring import COMPETITIONS, ScoreResult, score
from ._common import (
    DEFAULT_ENV,
    QUIET,
    Parser,
    Terminated,
    UsageError,
    add_env_options,
    as_options,
    at_least,
    check_plot,
    derive_seeds,
    load_agent,
    make_env,
    parse_max_iter,
    run_until_stopped,
)

__all__ = ["main"]


def _parser() -> Parser:
    parser = Parser(
        prog="asyncrunner score",
        description=(
            "Score agents as grid2op's competition classes do (grid2op.utils.ScoreL2RPN2020, "
            "ScoreL2RPN2022, ScoreL2RPN2023, ScoreICAPS2021): the reference agents and every "
            "agent play the same scenarios at once."
        ),
    )
    parser.add_argument(
        "env",
        metavar="ENV",
        nargs="?",
        default=DEFAULT_ENV,
        help=f"grid2op env name or path to an env folder (default: {DEFAULT_ENV})",
    )
    parser.add_argument(
        "--agent",
        action="append",
        required=True,
        metavar="SPEC",
        help="a grid2op.Agent name, module:Name or path/to/file.py:Name (repeat to compare)",
    )
    parser.add_argument(
        "--competition",
        required=True,
        choices=sorted(COMPETITIONS),
        help="the competition whose score class to use",
    )
    parser.add_argument(
        "--nb-scenario",
        type=at_least(1),
        default=None,
        metavar="N",
        help="scenarios (chronics) to play (default: the score class's, 16)",
    )
    parser.add_argument(
        "--max-step",
        type=parse_max_iter,
        default=None,
        metavar="M",
        help="steps per scenario, or -1 for every step (default: the score class's, -1)",
    )
    parser.add_argument(
        "--seed",
        type=at_least(0),
        default=None,
        metavar="S",
        help="derive one env seed and one agent seed per scenario from S (needs --nb-scenario)",
    )
    parser.add_argument(
        "--workers",
        type=at_least(1),
        default=None,
        metavar="W",
        help=(
            "worker processes in all, for every agent and reference "
            "(default: the CPUs this process may use)"
        ),
    )
    parser.add_argument(
        "--save",
        default=None,
        type=os.path.expanduser,  # --save=~/runs: the shell leaves "~" as it is
        metavar="DIR",
        help="save the episodes in DIR, one folder per agent and per reference played",
    )
    parser.add_argument("--resume", action="store_true", help="with --save: complete a score")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument(
        "--plot",
        default=None,
        type=os.path.expanduser,
        metavar="FILE.png",
        help="draw each agent's scenario scores",
    )
    add_env_options(parser)
    parser.add_argument(
        "--cache-dir",
        default=None,
        type=os.path.expanduser,
        metavar="DIR",
        help="where the reference statistics are cached (default: ~/.cache/asyncrunner/scores)",
    )
    return parser


def main(argv: Sequence[str]) -> int:
    """Entry point of ``asyncrunner score``; returns the exit status."""
    for message in QUIET:
        warnings.filterwarnings("ignore", message=message)
    parser = _parser()
    args = parser.parse_args(list(argv))
    if args.resume and args.save is None:
        parser.error("--resume needs --save DIR: the folder of the score to resume")
    if args.plot is not None:
        check_plot(parser, Path(args.plot))
    if args.seed is not None and args.nb_scenario is None:
        parser.error("--seed needs --nb-scenario N (one seed pair per scenario)")
    try:
        agents = [load_agent(spec) for spec in args.agent]
        with parsing_once():  # (as `asyncrunner run`'s)
            env = make_env(args.env, test=args.test, backend=args.backend)
    except UsageError as exc:
        parser.error(str(exc))
    from grid2op.Exceptions import Grid2OpException  # grid2op is loaded by now (the env)

    if args.save is not None and not args.resume:
        from ._show import note_earlier_episodes

        note_earlier_episodes(args.save, "score")
    try:
        nb = args.nb_scenario
        seeds: tuple[Any, Any] = (None, None)
        if args.seed is not None:
            seeds = derive_seeds(args.seed, nb)
        results = run_until_stopped(
            score(
                env,
                agents,
                competition=args.competition,
                nb_scenario=nb,
                max_step=args.max_step,
                env_seeds=seeds[0],
                agent_seeds=seeds[1],
                workers=args.workers,
                path_save=args.save,
                resume=args.resume,
                cache_dir=args.cache_dir,
            )
        )
    except ValueError as exc:
        parser.error(as_options(str(exc)))
    except EpisodeError as exc:
        notes = "".join(f"\n{note}" for note in getattr(exc, "__notes__", ()))
        print(f"asyncrunner score: {str(exc).rstrip()}{notes}", file=sys.stderr)
        return 1
    except Grid2OpException as exc:  # the competition's class refused the env (before any episode)
        notes = "".join(f" {note}." for note in getattr(exc, "__notes__", ()))
        parser.error(f"{args.competition} on this env: {exc}{notes}")
    except KeyboardInterrupt as exc:
        again = " (add --resume to complete it)" if args.save else ""
        terminated = exc if isinstance(exc, Terminated) else None
        why = terminated.why if terminated else "interrupted"
        with contextlib.suppress(OSError):  # a terminal hung up: nothing can be written
            print(f"asyncrunner score: {why}{again}", file=sys.stderr)
        return terminated.status if terminated else 130
    finally:
        env.close()
    if args.json:
        print(json.dumps([_as_dict(r) for r in results], indent=2))
    else:
        _print_table(results)
    if args.plot is not None:
        figure(results).savefig(args.plot)
        print(f"plot written to {args.plot}", file=sys.stderr if args.json else sys.stdout)
    return 0


def _as_dict(result: ScoreResult) -> dict[str, Any]:
    return {
        "agent": result.agent,
        "competition": result.competition,
        "total": result.total,
        "references_reused": result.references_reused,
        "path": result.path,
        "scenarios": [
            {
                "name": s.name,
                "score": s.score,
                "components": dict(s.components),
                "steps_survived": s.steps_survived,
                "total_steps": s.total_steps,
            }
            for s in result.scenarios
        ],
    }


def _print_table(results: Sequence[ScoreResult]) -> None:
    header = ["scenario"]
    for r in results:
        header += [f"{r.agent} score", "survived"]
    rows = []
    for i, first in enumerate(results[0].scenarios):
        row = [first.name]
        for r in results:
            s = r.scenarios[i]
            row += [f"{s.score:.2f}", f"{s.steps_survived}/{s.total_steps}"]
        rows.append(row)
    total = ["total"]
    for r in results:
        survived = sum(s.steps_survived for s in r.scenarios)
        steps = sum(s.total_steps for s in r.scenarios)
        total += [f"{r.total:.2f}", f"{survived}/{steps}"]
    rows.append(total)
    widths = [max([len(h), *(len(row[i]) for row in rows)]) for i, h in enumerate(header)]
    for row in [header, *rows]:
        cells = [c.ljust(widths[0]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(row)]
        print("  ".join(cells).rstrip())
    reused = results[0].references_reused
    print(
        f"{results[0].competition}: the total is the mean of the scenarios' scores; reference "
        f"statistics {'reused from the cache' if reused else 'computed in this run (now cached)'}"
    )


def figure(results: Sequence[ScoreResult]) -> Any:
    """Score per scenario per agent (grouped bars) and steps survived (a matplotlib Figure)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    names = [s.name for s in results[0].scenarios]
    x = np.arange(len(names))
    width = 0.8 / len(results)
    fig, (scores, survival) = plt.subplots(1, 2, figsize=(13, 5.2))
    # The scenario's length behind each group of survival bars.
    lengths = [s.total_steps for s in results[0].scenarios]
    survival.bar(x, lengths, 0.9, color="lightgrey", label="scenario length")
    for i, r in enumerate(results):
        offset = (i - (len(results) - 1) / 2) * width
        label = f"{r.agent} (total {r.total:.1f})"
        bars = scores.bar(x + offset, [s.score for s in r.scenarios], width, label=label)
        # A score of 0 (DoNothing's level) draws no bar: its value says it is there.
        scores.bar_label(bars, fmt="%.1f", fontsize="x-small", padding=2)
        survival.bar(x + offset, [s.steps_survived for s in r.scenarios], width, label=r.agent)
    scores.axhline(0, color="grey", linewidth=0.8)
    # grid2op's scores range from -100 (game over at once) to 100, 0 being DoNothing's; some
    # competitions' go lower (icaps_2021's alarm part, l2rpn_2023's assistant part: to -150).
    lowest = min([-100.0, *(s.score for r in results for s in r.scenarios)])
    scores.set_ylim(1.1 * lowest, 110)
    scores.set(xlabel="scenario", ylabel="score", title=f"Score ({results[0].competition})")
    survival.set_ylim(0, 1.1 * max(lengths))
    survival.set(xlabel="scenario", ylabel="steps survived", title="Survival")
    for ax in (scores, survival):
        ax.set_xticks(x, names, rotation=45, ha="right")
        # Below the axes, so the legend never covers a bar.
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=2, fontsize="small")
    fig.tight_layout()
    plt.close(fig)
    return fig
