"""``asyncrunner bench --plot FILE.png``: each configuration's throughput against the limit
(N × the bare loop), and the workers sweep when ``--workers`` listed several counts."""

from __future__ import annotations

from typing import Any

__all__ = ["figure"]


def figure(report: dict[str, Any]) -> Any:
    """The bench's figure (a matplotlib Figure)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg, ours = report["config"], report["asyncrunner"]
    n = cfg["workers"]
    rows = [
        (f"grid2op Runner (nb_process={n})", report["grid2op"]),
        ("AsyncRunner cold", ours["cold"]),
        ("AsyncRunner warm", ours["warm"]),
        ("AsyncRunner warm, no sink", ours["warm_no_sinks"]),
        ("AsyncRunner warm, every sink", ours["warm_all_sinks"]),
    ]
    rows = [(label, part["steps_per_s"]) for label, part in rows if part is not None]
    swept = len(report["sweep"]) > 1
    fig, axes = plt.subplots(1, 2 if swept else 1, figsize=(13 if swept else 8, 4.8), squeeze=False)
    bars = axes[0][0]
    bars.barh([label for label, _ in rows], [rate or 0 for _, rate in rows], color="tab:blue")
    bars.invert_yaxis()
    limit = report["sweep"][-1]["limit_steps_per_s"]
    at_once = report["bare_loops_at_once"]
    if limit is not None:
        bars.axvline(limit, color="tab:red", linestyle="--", label=f"limit: {n} × bare loop")
    if at_once is not None:
        bars.axvline(
            at_once["steps_per_s"],
            color="tab:orange",
            linestyle=":",
            label=f"{n} bare loops at once",
        )
    if limit is not None or at_once is not None:
        bars.legend(loc="lower right")
    bars.set(
        xlabel="steps/s",
        title=f"{cfg['env']}, {cfg['agent']}, {cfg['episodes']} episodes, N={n} (path_save)",
    )
    if swept:
        lines = axes[0][1]
        counts = [row["workers"] for row in report["sweep"]]
        for key, label, style in (
            ("limit_steps_per_s", "limit (N × bare loop)", "--"),
            ("grid2op_steps_per_s", "grid2op Runner", "-"),
            ("cold_steps_per_s", "AsyncRunner cold", "-"),
            ("warm_steps_per_s", "AsyncRunner warm", "-"),
        ):
            values = [row[key] for row in report["sweep"]]
            if any(v is not None for v in values):
                lines.plot(counts, values, style, marker="o", label=label)
        lines.set(xlabel="workers (N)", ylabel="steps/s", title="Workers sweep", xticks=counts)
        lines.legend(loc="upper left")
    fig.tight_layout()
    return fig
