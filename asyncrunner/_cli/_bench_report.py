"""The figures of ``asyncrunner bench`` (ratios, streaming cost, agreement) and its report.

``--json`` prints one JSON object instead of the table (times in seconds, memory in MiB, lags in
milliseconds; ``null`` where a figure was not measured, e.g. ``grid2op`` under ``--skip-grid2op``):

- ``version``: 1, the layout of this object.
- ``config``: ``env``, ``test``, ``backend`` (the backend class used), ``agent``, ``episodes``,
  ``workers`` (the largest of ``sweep_workers``: the whole bench ran with it),
  ``sweep_workers`` (the counts ``--workers`` listed), ``max_iter``, ``seed``, ``loop``
  (``"asyncio"`` / ``"trio"``), ``copy_env`` (``--copy-env``), ``repeat`` (``--repeat``),
  ``episode_ids``, ``env_seeds``,
  ``agent_seeds`` (what every contender played), ``cpu_count`` (the CPUs the bench may use),
  ``versions`` (``python``, ``grid2op``, ``lightsim2grid``, ``anyio``, ``asyncrunner``: str or null).
- ``lag_probe``: ``enabled`` (``--lag-probe``, the default), ``tick_ms`` (1.0),
  ``cpu_us_per_wakeup`` (CPU this process spends per wake-up of the ticker, measured for 0.5 s
  with nothing else running, before the lag pass; null when disabled).
- ``bare_loop``, ``grid2op``: a *timing*: ``seconds``, ``episodes``, ``steps``, ``steps_per_s``,
  ``episodes_per_s``; ``grid2op`` also has ``nb_process``.
- ``bare_loops_at_once``: N bare loops played at once in forked processes, the episodes dealt
  round-robin (what this machine gives N busy processes; the limit assumes N times one loop): a
  timing whose ``steps_per_s`` adds up each loop's and ``seconds`` is the longest loop's, plus
  ``processes`` (N, or fewer with fewer episodes); null where processes cannot be forked (not
  Linux) or a loop failed.
- ``asyncrunner``: ``cold``, ``warm``, ``warm_no_sinks``, ``warm_all_sinks``: each a timing plus
  ``loop_lag_ms`` (``p50``, ``p99``, ``max``, ``samples``: the 1 ms ticker's wake-up delays
  beside the same run in the lag pass; null under ``--no-lag-probe``); ``first_step_s`` (for each worker that played, seconds from
  the start, i.e. the runner's construction for ``cold`` and the ``run()`` call otherwise, to
  the parent receiving that worker's first ``EpisodeStarted``, in increasing order; null for
  ``warm_no_sinks``, which has no sink to tell) and ``first_step_max_s`` (the slowest worker);
  ``parent_cpu_s`` (CPU time this process spent during the timed run, all its threads: the
  event loop and the sinks' threads; ``cold``'s from the runner's construction, as its time)
  and ``parent_cpu_us_per_step`` (the same per step played: what orchestrating and sinks cost
  this process, steadier than times on a busy machine; on a machine with no spare core it is
  taken from the workers).
  ``warm_all_sinks`` also has ``sinks`` (the class names attached). The three warm runs are
  played ``repeat`` times, in turns: each is the run of median time, with ``seconds_each``
  (every turn's time, in the order played).
- ``ratios``: ``cold_vs_grid2op``, ``warm_vs_grid2op`` (AsyncRunner steps/s over grid2op's),
  ``cold_vs_bare``, ``warm_vs_bare`` (AsyncRunner steps/s over N × the bare loop's),
  ``cold_vs_bare_at_once``, ``warm_vs_bare_at_once`` (over N bare loops at once),
  ``bare_at_once_vs_bare`` (the loops at once over that many × one: how far the machine
  scales),
  ``all_sinks_vs_no_sinks`` (steps/s with every sink over steps/s with none).
- ``projection``: how many workers one orchestrating process can feed, from the warm run with
  ``path_save``: ``parent_cpu_us_per_step``, ``steps_per_s_per_worker`` (its steps/s over N),
  ``parent_steps_per_s`` (the steps/s at which this process would use one whole core:
  10^6 / CPU µs per step) and ``workers_fed`` (``parent_steps_per_s`` over the per-worker rate).
- ``sweep``: one row per worker count of ``--workers`` (one row without a sweep), in increasing
  order: ``workers``, ``limit_steps_per_s`` (that many × the bare loop), ``grid2op_steps_per_s``,
  ``cold_steps_per_s``, ``warm_steps_per_s`` (AsyncRunner with ``path_save``),
  ``warm_vs_limit``, ``warm_vs_grid2op``, ``parent_cpu_us_per_step`` (warm).
- ``streaming_cost``: ``sinks`` (class names), ``no_sinks_steps_per_s``,
  ``all_sinks_steps_per_s``, ``ratio`` (the same as ``ratios.all_sinks_vs_no_sinks``),
  ``slowdown_percent`` (``100 × (1 - ratio)``).
- ``agreement``: ``steps_agree`` (every AsyncRunner run and grid2op's Runner played the same total
  of steps), ``results_agree`` (and the same (chronic, steps, reward) per episode; without
  grid2op's Runner: null, or false where the AsyncRunner runs differ),
  ``asyncrunner_steps``, ``grid2op_steps``, ``bare_loop_steps`` (totals), ``detail`` (one line).
- ``errors``: ``grid2op``, ``asyncrunner``: null, or the one-line error that stopped that
  contender (its figures are then null; the exit status is 1).
- ``memory``: ``ru_maxrss_mb`` (this process's peak RSS over the whole bench, from
  ``resource.getrusage``), ``rss_start_mb``, ``rss_before_asyncrunner_mb``,
  ``rss_after_asyncrunner_mb`` (``VmRSS`` from ``/proc/self/status``),
  ``peak_during_asyncrunner_mb`` (``VmHWM`` reset before the AsyncRunner runs, where Linux allows).
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "JSON_VERSION",
    "KEYS",
    "agreement",
    "finite",
    "first_line",
    "print_report",
    "projection",
    "ratios",
    "streaming_cost",
    "sweep",
    "unwrap_single",
]

JSON_VERSION = 1
# The top-level keys of the JSON report, in order.
KEYS = (
    "version",
    "config",
    "lag_probe",
    "bare_loop",
    "bare_loops_at_once",
    "grid2op",
    "asyncrunner",
    "ratios",
    "projection",
    "sweep",
    "streaming_cost",
    "agreement",
    "errors",
    "memory",
)


# --- figures -----------------------------------------------------------------------------------


def _steps_per_s(part: dict[str, Any] | None) -> float | None:
    return None if part is None else part.get("steps_per_s")


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or not b:
        return None
    return finite(a / b)


def ratios(report: dict[str, Any], workers: int) -> dict[str, float | None]:
    ours = report["asyncrunner"]
    bare = _steps_per_s(report["bare_loop"])
    limit = None if bare is None else workers * bare
    g2op = _steps_per_s(report["grid2op"])
    loops = report["bare_loops_at_once"]
    at_once = _steps_per_s(loops)
    one = None if bare is None or loops is None else loops["processes"] * bare
    cold, warm = _steps_per_s(ours["cold"]), _steps_per_s(ours["warm"])
    return {
        "cold_vs_grid2op": _ratio(cold, g2op),
        "warm_vs_grid2op": _ratio(warm, g2op),
        "cold_vs_bare": _ratio(cold, limit),
        "warm_vs_bare": _ratio(warm, limit),
        "cold_vs_bare_at_once": _ratio(cold, at_once),
        "warm_vs_bare_at_once": _ratio(warm, at_once),
        "bare_at_once_vs_bare": _ratio(at_once, one),
        "all_sinks_vs_no_sinks": _ratio(
            _steps_per_s(ours["warm_all_sinks"]), _steps_per_s(ours["warm_no_sinks"])
        ),
    }


def projection(warm: dict[str, Any] | None, workers: int) -> dict[str, float | None]:
    """How many workers one parent process can feed at the warm run's per-worker rate."""
    cpu = None if warm is None else warm.get("parent_cpu_us_per_step")
    rate = _ratio(_steps_per_s(warm), workers)
    parent = None if not cpu else finite(1e6 / cpu)
    return {
        "parent_cpu_us_per_step": cpu,
        "steps_per_s_per_worker": rate,
        "parent_steps_per_s": parent,
        "workers_fed": _ratio(parent, rate),
    }


def sweep(
    bare: dict[str, Any] | None,
    points: dict[int, tuple[dict[str, Any] | None, dict[str, Any]]],
) -> list[dict[str, Any]]:
    """One row per worker count: ``points[n]`` is (grid2op's timing, the AsyncRunner runs)."""
    rows = []
    for n, (g2op, ours) in points.items():
        bare_rate = _steps_per_s(bare)
        limit = None if bare_rate is None else n * bare_rate
        warm = ours.get("warm")
        rows.append(
            {
                "workers": n,
                "limit_steps_per_s": limit,
                "grid2op_steps_per_s": _steps_per_s(g2op),
                "cold_steps_per_s": _steps_per_s(ours.get("cold")),
                "warm_steps_per_s": _steps_per_s(warm),
                "warm_vs_limit": _ratio(_steps_per_s(warm), limit),
                "warm_vs_grid2op": _ratio(_steps_per_s(warm), _steps_per_s(g2op)),
                "parent_cpu_us_per_step": None if warm is None else warm["parent_cpu_us_per_step"],
            }
        )
    return rows


def streaming_cost(report: dict[str, Any]) -> dict[str, Any]:
    ours = report["asyncrunner"]
    ratio = report["ratios"]["all_sinks_vs_no_sinks"]
    every = ours["warm_all_sinks"]
    return {
        "sinks": None if every is None else every["sinks"],
        "no_sinks_steps_per_s": _steps_per_s(ours["warm_no_sinks"]),
        "all_sinks_steps_per_s": _steps_per_s(every),
        "ratio": ratio,
        "slowdown_percent": None if ratio is None else 100.0 * (1.0 - ratio),
    }


def agreement(
    bare: list[tuple[str, int, float]],
    g2op: list[tuple[str, int, float]] | None,
    ours: dict[str, list[tuple[str, int, float]]],
) -> dict[str, Any]:
    totals = {name: sum(r[1] for r in rows) for name, rows in ours.items()}
    our_steps = next(iter(totals.values()), None)
    g2op_steps = None if g2op is None else sum(r[1] for r in g2op)
    bare_steps = sum(r[1] for r in bare)
    if not ours:
        steps_agree = results_agree = None
        detail = "no AsyncRunner run finished: nothing to compare"
    elif len(set(totals.values())) > 1:
        steps_agree = results_agree = False
        listed = ", ".join(f"{name} {steps}" for name, steps in totals.items())
        detail = f"the AsyncRunner runs played different totals of steps: {listed}"
    elif g2op is None:
        steps_agree = None
        same = all(sorted(rows) == sorted(next(iter(ours.values()))) for rows in ours.values())
        results_agree = None if same else False  # (the exit status says so)
        detail = f"grid2op's Runner not run; the AsyncRunner runs each played {our_steps} steps" + (
            "" if same else " but their per-episode rewards or steps DIFFER"
        )
    else:
        steps_agree = our_steps == g2op_steps
        results_agree = steps_agree and all(sorted(rows) == sorted(g2op) for rows in ours.values())
        if results_agree:
            detail = (
                f"AsyncRunner and grid2op's Runner agree: {our_steps} steps in total, the same "
                "steps and reward for each episode"
            )
        elif steps_agree:
            detail = (
                f"AsyncRunner and grid2op's Runner played the same {our_steps} steps in total but "
                "their per-episode rewards or steps DIFFER"
            )
        else:
            detail = (
                f"AsyncRunner and grid2op's Runner DISAGREE: {our_steps} steps vs {g2op_steps}: "
                "the comparison is not of equal work"
            )
    if bare_steps != our_steps and our_steps is not None:
        detail += f" (the bare loop played {bare_steps})"
    return {
        "steps_agree": steps_agree,
        "results_agree": results_agree,
        "asyncrunner_steps": our_steps,
        "grid2op_steps": g2op_steps,
        "bare_loop_steps": bare_steps,
        "detail": detail,
    }


def finite(value: float) -> float | None:
    return value if value == value and value not in (float("inf"), float("-inf")) else None


def first_line(text: str, limit: int = 300) -> str:
    """The first line of ``text`` (an error's message, not the traceback it may carry)."""
    lines = text.strip().splitlines()
    line = lines[0].strip() if lines else ""
    return line if len(line) <= limit else line[: limit - 1] + "…"


def unwrap_single(exc: BaseException) -> BaseException:
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


# --- text report -------------------------------------------------------------------------------


def _num(value: float | None, spec: str = ",.0f", unit: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{unit}"


def print_report(report: dict[str, Any]) -> None:
    cfg, ours = report["config"], report["asyncrunner"]
    n = cfg["workers"]
    max_iter = "env default" if cfg["max_iter"] is None else cfg["max_iter"]
    versions = ", ".join(f"{k} {v}" for k, v in cfg["versions"].items() if v is not None)
    print(
        f"asyncrunner bench: {cfg['env']}{' (test)' if cfg['test'] else ''} on {cfg['backend']}, "
        f"{cfg['agent']}, {cfg['episodes']} episodes, N={n}, max_iter={max_iter}, "
        f"seed {cfg['seed']}, {cfg['loop']}{', copy_env' if cfg['copy_env'] else ''}"
    )
    print(f"{versions}; {cfg['cpu_count']} CPUs")
    print()
    rows = [
        ("bare loop (1 process, no saving)", report["bare_loop"]),
        (f"{n} bare loops at once (forked processes)", report["bare_loops_at_once"]),
        (f"grid2op Runner (nb_process={n}, path_save)", report["grid2op"]),
        (f"AsyncRunner cold (workers={n}, path_save)", ours["cold"]),
        ("AsyncRunner warm (path_save)", ours["warm"]),
        ("AsyncRunner warm, no sink", ours["warm_no_sinks"]),
        ("AsyncRunner warm, every sink", ours["warm_all_sinks"]),
    ]
    width = max(len(label) for label, _ in rows)
    print(f"{'':{width}}  {'seconds':>8}  {'steps':>7}  {'steps/s':>8}  {'episodes/s':>10}")
    for label, part in rows:
        if part is None:
            if "at once" in label:
                missing = "-"  # not on this system, or a loop failed (the one-process loop tells)
            elif "grid2op" in label and not report["errors"]["grid2op"]:
                missing = "skipped"
            else:
                missing = "failed"
            print(f"{label:{width}}  {missing:>8}")
            continue
        print(
            f"{label:{width}}  {part['seconds']:8.2f}  {part['steps']:7d}  "
            f"{_num(part['steps_per_s']):>8}  {_num(part['episodes_per_s'], '.2f'):>10}"
        )
    each = [
        f"{label} " + ", ".join(f"{t:.2f}" for t in ours[name]["seconds_each"])
        for name, label in (
            ("warm", "warm"),
            ("warm_no_sinks", "no sink"),
            ("warm_all_sinks", "every sink"),
        )
        if ours[name] is not None
    ]
    if cfg["repeat"] > 1 and each:
        print(
            f"(warm rows: the median of {cfg['repeat']} runs in turns; seconds: {'; '.join(each)})"
        )
    ratios = report["ratios"]
    print()
    print(f"{'ratio (steps/s, = episodes/s)':{width}}  {'cold':>8}  {'warm':>7}")
    for label, key in (
        ("AsyncRunner / grid2op Runner", "grid2op"),
        (f"AsyncRunner / ({n} × bare loop)", "bare"),
        (f"AsyncRunner / ({n} bare loops at once)", "bare_at_once"),
    ):
        cold, warm = ratios[f"cold_vs_{key}"], ratios[f"warm_vs_{key}"]
        print(f"{label:{width}}  {_num(cold, '.2f', '×'):>8}  {_num(warm, '.2f', '×'):>7}")
    k = 0 if report["bare_loops_at_once"] is None else report["bare_loops_at_once"]["processes"]
    if ratios["bare_at_once_vs_bare"] is not None and k > 1:
        print(
            f"({k} bare loops at once ran at {ratios['bare_at_once_vs_bare']:.2f}× {k} times one: "
            f"what this machine gives {k} busy processes, against the limit's 1.00×)"
        )
    if any(part is not None for part in ours.values()):
        print()
        _print_runs(report, width)
    if len(report["sweep"]) > 1:
        print()
        _print_sweep(report["sweep"], width)
    proj = report["projection"]
    if proj["workers_fed"] is not None:
        print(
            f"projection: at {proj['parent_cpu_us_per_step']:,.0f} µs of CPU per step (warm, "
            f"path_save) this process would fill one core at {proj['parent_steps_per_s']:,.0f} "
            f"steps/s: enough for about {proj['workers_fed']:,.0f} workers at this run's "
            f"{proj['steps_per_s_per_worker']:,.0f} steps/s per worker"
        )
    cost = report["streaming_cost"]
    if cost["ratio"] is not None:
        print(
            f"streaming cost: every sink ({', '.join(cost['sinks'])}) "
            f"{_num(cost['all_sinks_steps_per_s'])} steps/s vs no sink "
            f"{_num(cost['no_sinks_steps_per_s'])} steps/s: {cost['ratio']:.2f}× "
            f"({abs(cost['slowdown_percent']):.1f} % "
            f"{'slower' if cost['slowdown_percent'] >= 0 else 'faster: noise'})"
        )
    mem = report["memory"]
    print(
        f"parent memory: peak RSS {_num(mem['ru_maxrss_mb'])} MiB over the bench (ru_maxrss); "
        f"RSS {_num(mem['rss_before_asyncrunner_mb'])} MiB before the AsyncRunner runs, "
        f"{_num(mem['rss_after_asyncrunner_mb'])} MiB after, peak "
        f"{_num(mem['peak_during_asyncrunner_mb'])} MiB during them"
    )
    print(f"results: {report['agreement']['detail']}")


def _print_runs(report: dict[str, Any], width: int) -> None:
    cfg, ours, probe = report["config"], report["asyncrunner"], report["lag_probe"]
    n = cfg["workers"]

    header = (
        f"{'AsyncRunner run':{width}}  {'loop lag p50/p99/max (ms)':>25}  "
        f"{'first step per worker (s)':>25}  {'parent CPU/step':>15}"
    )
    print(header)
    for key, part in ours.items():
        if part is None:
            continue
        lag = part["loop_lag_ms"]
        lags = "-"
        if lag is not None:
            lags = (
                f"{_num(lag['p50'], '.2f')} / {_num(lag['p99'], '.1f')} / {_num(lag['max'], '.1f')}"
            )
        firsts = ", ".join(f"{t:.2f}" for t in part["first_step_s"] or []) or "-"
        started, expected = len(part["first_step_s"] or []), min(n, cfg["episodes"])
        if part["first_step_s"] is not None and started < expected:
            firsts += f" (only {started} of {expected} workers)"
        cpu = _num(part["parent_cpu_us_per_step"], ",.0f", " µs")
        print(f"{key.replace('_', ' '):{width}}  {lags:>25}  {firsts:>25}  {cpu:>15}")
    if probe["enabled"]:
        print(
            f"(loop lag: how late a {probe['tick_ms']:g} ms sleep wakes up beside the same runs "
            f"played again; each wake-up costs this process "
            f"{_num(probe['cpu_us_per_wakeup'], '.0f')} µs of CPU, kept out of the timed runs)"
        )
    print(
        "(first step: from the runner's construction for cold, from run() otherwise; "
        "parent CPU: event loop and sink threads)"
    )


def _print_sweep(rows: list[dict[str, Any]], width: int) -> None:
    print(
        f"{'workers sweep (steps/s)':{width}}  {'limit':>8}  {'grid2op':>8}  {'cold':>8}  "
        f"{'warm':>8}  {'warm/limit':>10}  {'warm/grid2op':>12}  {'parent CPU/step':>15}"
    )
    for row in rows:
        print(
            f"{'N = ' + str(row['workers']):{width}}  {_num(row['limit_steps_per_s']):>8}  "
            f"{_num(row['grid2op_steps_per_s']):>8}  {_num(row['cold_steps_per_s']):>8}  "
            f"{_num(row['warm_steps_per_s']):>8}  {_num(row['warm_vs_limit'], '.2f', '×'):>10}  "
            f"{_num(row['warm_vs_grid2op'], '.2f', '×'):>12}  "
            f"{_num(row['parent_cpu_us_per_step'], ',.0f', ' µs'):>15}"
        )
