"""grid2op's side of scoring: its score classes, the reference agents they play, and their
``EpisodeStatistics`` (computed by grid2op's own code, cached in our folder)."""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import inspect
import json
import os
import secrets
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from .._engine._parsed import cache_home
from .._engine._recipe import env_key
from .._plan._arguments import check_path_save, chronic_names
from ..sinks._npz import npz_bytes

__all__ = [
    "COMPETITIONS",
    "ScorePlan",
    "agent_label",
    "compute_stats",
    "default_cache_dir",
    "grid2op_scores",
]

# Competition name -> grid2op's class (in grid2op.utils).
COMPETITIONS = {
    "l2rpn_2020": "ScoreL2RPN2020",
    "l2rpn_wcci_2022": "ScoreL2RPN2022",
    "l2rpn_2023": "ScoreL2RPN2023",
    "icaps_2021": "ScoreICAPS2021",
}
# Marks a cache entry grid2op's post-processing finished writing (written last), with the size
# of each of its files.
_COMPLETE = ".asyncrunner_complete"


@dataclass
class _Reference:
    attr: str  # the score object's attribute holding these statistics
    name: str  # grid2op's statistics name
    agent: Any  # the agent instance grid2op plays (None: DoNothing)
    parameters: Any  # None: the env's
    stats: Any = None
    reused: bool = False


def default_cache_dir() -> str:
    return os.path.join(cache_home(), "scores")


def agent_label(agent: Any) -> str:
    from .._engine._central import CentralAgent

    if isinstance(agent, CentralAgent):
        return agent_label(agent.agent)  # the agent it holds, as its saved episodes name it
    if isinstance(agent, functools.partial):
        return agent_label(agent.func)  # the class (or factory) it calls
    if isinstance(agent, type):
        return agent.__name__
    name = getattr(agent, "__name__", None)
    return name if isinstance(name, str) else type(agent).__name__


@dataclass
class ScorePlan:
    """What a score plays, built before any worker starts (off the event loop: it reads files
    and copies the env)."""

    scorer: Any
    refs: list[_Reference]
    todo: list[_Reference]  # the references not in the cache
    labels: list[str]
    nb: int
    max_iter: int
    root: str  # where every runner saves its episodes (one folder each)
    tmp: tempfile.TemporaryDirectory[str] | None
    jobs: list[tuple[str, Any, Any]]  # (folder, env, agent) of each runner: references first
    envs: list[Any]

    @classmethod
    def make(
        cls,
        env: Any,
        agents: list[Any],
        *,
        competition: str,
        nb_scenario: int | None,
        max_step: int | None,
        env_seeds: Sequence[int] | None,
        agent_seeds: Sequence[int] | None,
        path_save: str | os.PathLike[str] | None,
        cache_dir: str | os.PathLike[str] | None,
    ) -> ScorePlan:
        from grid2op.Agent import DoNothingAgent

        scorer, refs = _scorer(
            competition, env, nb_scenario=nb_scenario, max_step=max_step,
            env_seeds=env_seeds, agent_seeds=agent_seeds,
        )  # fmt: skip
        labels = _unique([agent_label(a) for a in agents], taken={ref.name for ref in refs})
        cache_root = check_path_save(
            cache_dir if cache_dir is not None else default_cache_dir(),
            "cache_dir",
            "keep the reference statistics in",
        )
        data = _played_data(env, int(scorer.nb_scenario))
        for ref in refs:
            ref.stats = _stats_for(scorer, ref, cache_root, data, env_seeds, agent_seeds)
            ref.reused = _intact(ref.stats.path_save_stats)
        todo = [ref for ref in refs if not ref.reused]
        if path_save is not None:
            path_save = check_path_save(path_save)
        envs: dict[str, Any] = {}
        jobs: list[tuple[str, Any, Any]] = []
        try:
            for ref in todo:
                params = ref.parameters if ref.parameters is not None else env.parameters
                agent = DoNothingAgent if ref.agent is None else type(ref.agent)
                jobs.append((ref.name, _scored_env(env, scorer, params, envs), agent))
            for label, agent in zip(labels, agents, strict=True):
                jobs.append((label, _scored_env(env, scorer, env.parameters, envs), agent))
        except (
            BaseException
        ) as exc:  # the score functions refuse the env (icaps_2021 without alarms)
            for built in envs.values():
                built.close()
            if competition == "icaps_2021" and not getattr(env, "_has_attention_budget", True):
                # (grid2op's message says to change the env's reward class)
                exc.add_note(
                    "icaps_2021 scores the alarms of an env with an attention budget, such as "
                    "l2rpn_icaps_2021"
                )
            raise
        tmp = None
        if path_save is None:
            tmp = tempfile.TemporaryDirectory(prefix="asyncrunner-score-")
        root = os.path.abspath(path_save if path_save is not None else tmp.name)  # type: ignore[union-attr]
        return cls(
            scorer, refs, todo, labels, int(scorer.nb_scenario), int(scorer.max_step), root, tmp,
            jobs, list(envs.values()),
        )  # fmt: skip

    def close(self) -> None:
        for env in self.envs:
            env.close()
        if self.tmp is not None:
            self.tmp.cleanup()


def _unique(labels: list[str], taken: set[str]) -> list[str]:
    """``labels`` made unique (each is a folder of the score's): a label met again, or one of
    ``taken`` (the references' folders), gets the first suffix ``_2``, ``_3``... that is no
    other label (agents ``A``, ``A``, ``A_2``: ``A``, ``A_3``, ``A_2``)."""
    first = {label: i for i, label in reversed(list(enumerate(labels)))}
    used = taken | set(labels)
    out = []
    for i, label in enumerate(labels):
        if first[label] != i or label in taken:
            n = 2
            while f"{label}_{n}" in used:
                n += 1
            label = f"{label}_{n}"
            used.add(label)
        out.append(label)
    return out


def _scorer(
    competition: str,
    env: Any,
    *,
    nb_scenario: int | None,
    max_step: int | None,
    env_seeds: Sequence[int] | None,
    agent_seeds: Sequence[int] | None,
) -> tuple[Any, list[_Reference]]:
    """grid2op's score object for these arguments, with its references noted, not computed."""
    import grid2op.utils

    cls = getattr(grid2op.utils, COMPETITIONS[competition])
    scorer = cls.__new__(cls)
    refs: list[_Reference] = []

    # The constructor asks _init_stat for each reference: note what it would compute.
    def note(
        stat: Any, stat_name: str, computed: Any, parameters: Any = None,
        nb_process_stats: int = 1, agent: Any = None, score_names: Any = None,
    ) -> bool:  # fmt: skip
        attr = next(a for a, v in vars(scorer).items() if v is stat)
        refs.append(_Reference(attr, stat_name, agent, parameters))
        return False

    scorer._init_stat = note
    kwargs: dict[str, Any] = {"env_seeds": env_seeds, "agent_seeds": agent_seeds}
    if nb_scenario is not None:
        kwargs["nb_scenario"] = nb_scenario
    if max_step is not None:
        kwargs["max_step"] = max_step
    accepted = inspect.signature(cls.__init__).parameters
    cls.__init__(scorer, env, **{k: v for k, v in kwargs.items() if k in accepted})
    del scorer._init_stat
    _check_counts(
        int(scorer.nb_scenario), env_seeds, agent_seeds, _scenario_count(env), nb_scenario is None
    )
    return scorer, refs


def _scenario_count(env: Any) -> int | None:
    """How many scenarios the env plays before replaying one (None: not known here). The
    statistics name each scenario's folder after its chronic: a replayed one collides."""
    from grid2op.Chronics import (
        ChangeNothing,
        FromMultiEpisodeData,
        FromNPY,
        FromOneEpisodeData,
        GridStateFromFile,
    )

    names = chronic_names(env)
    if names is not None:
        return len(names)
    real = getattr(env.chronics_handler, "real_data", None)
    if isinstance(real, FromMultiEpisodeData):
        return len(real.li_ep_data)
    if isinstance(real, (ChangeNothing, FromNPY, FromOneEpisodeData, GridStateFromFile)):
        return 1
    return None


def _check_counts(
    nb: int,
    env_seeds: Sequence[int] | None,
    agent_seeds: Sequence[int] | None,
    scenarios: int | None,
    default: bool = False,
) -> None:
    if nb < 1:
        raise ValueError(f"`nb_scenario` must be >= 1, got {nb}")
    if scenarios is not None and nb > scenarios:
        # grid2op's classes would replay a chronic, whose statistics overwrite the first's.
        given = "(the score class's default) " if default else ""
        raise ValueError(
            f"`nb_scenario` is {nb} {given}but the env has {scenarios} "
            f"{'scenario' if scenarios == 1 else 'scenarios'} (chronics): ask for at most {scenarios}"
        )
    for name, seeds in (("env_seeds", env_seeds), ("agent_seeds", agent_seeds)):
        if seeds is not None and len(seeds) != nb:
            raise ValueError(f"`{name}` has {len(seeds)} seeds for {nb} scenarios: give one each")


def _played_data(env: Any, nb: int) -> dict[str, Any]:
    """What the references' statistics read from the env's files, for their cache key: the names
    of the scenarios played, in play order (the first ``nb`` of the env's, its chronics filter
    applied, as the runners play them), the names in its ``chronics`` folder (grid2op signs the
    statistics with them), and a fingerprint of the env's own files, of the played chronics'
    files and of those its chronics class was given elsewhere (``FromMultiEpisodeData``'s
    episodes): each one's path, size and times (stats only: no file is read)."""
    real = getattr(env.chronics_handler, "real_data", None)
    names = chronic_names(env)
    folders: list[str] = []
    if names is not None:
        names = names[:nb]
        by_name = {os.path.basename(str(p)): str(p) for p in getattr(real, "subpaths", [])}
        folders = [by_name[name] for name in names if name in by_name]
    else:  # one chronic (GridStateFromFile...) or none on disk (FromNPY...)
        path = getattr(real, "path", None)
        if isinstance(path, (str, os.PathLike)) and os.path.isdir(path):
            folders = [str(path)]
    home = os.path.realpath(env.get_path_env())
    files: list[tuple[str, int, int, int]] = []

    def note(path: str) -> None:
        info = os.stat(path)
        where = os.path.relpath(os.path.realpath(path), home)
        files.append((where, info.st_size, info.st_mtime_ns, info.st_ctime_ns))

    with os.scandir(home) as entries:  # the grid, config.py, prods_charac.csv, ...
        for entry in entries:
            if entry.is_file():
                note(entry.path)
    elsewhere = [
        p for p in _paths_in(getattr(env.chronics_handler, "_kwargs", {})) if _outside(p, home)
    ]
    for folder in [*folders, *elsewhere]:
        if os.path.isfile(folder):
            note(folder)
        for top, dirs, found in os.walk(folder):
            dirs.sort()
            for name in sorted(found):
                note(os.path.join(top, name))
    folders = [os.path.realpath(folder) for folder in folders]
    listed = os.path.join(home, "chronics")
    listing = sorted(os.listdir(listed)) if os.path.isdir(listed) else None
    return {"chronics": names, "folders": folders, "listed": listing, "files": sorted(files)}


def _paths_in(value: Any) -> list[str]:
    """The files and folders named in ``value`` (the chronics class's arguments, nested)."""
    if isinstance(value, (str, os.PathLike)):
        path = os.fspath(value)
        return [path] if isinstance(path, str) and os.path.exists(path) else []
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [path for item in value for path in _paths_in(item)]
    return []


def _outside(path: str, home: str) -> bool:
    """Whether ``path`` is outside the env's folder (whose files are fingerprinted otherwise)."""
    real = os.path.realpath(path)
    return os.path.commonpath([real, home]) != home


def _stats_for(
    scorer: Any,
    ref: _Reference,
    cache_root: str,
    data: dict[str, Any],
    env_seeds: Sequence[int] | None,
    agent_seeds: Sequence[int] | None,
) -> Any:
    """grid2op's ``EpisodeStatistics`` for ``ref``, in a cache folder named by what makes it."""
    import grid2op
    from grid2op.utils.underlying_statistics import EpisodeStatistics

    class Stats(EpisodeStatistics):  # type: ignore[misc]  # grid2op is untyped
        # The runners already played the episodes into path_save_stats: compute() only does
        # grid2op's post-processing of them.
        @staticmethod
        def run_env(**kwargs: Any) -> None:
            return None

        # grid2op writes each statistic with np.savez_compressed (zlib's level 6): most of the
        # post-processing's time (about 1.1 of 1.8 s for a 2023 score's two references). The same
        # file, the same arrays for np.load, deflated at level 1 by ISA-L (sinks._npz).
        @staticmethod
        def _save_numpy(path: str, array: Any) -> None:
            with open(path if path.endswith(".npz") else f"{path}.npz", "wb") as f:
                f.write(npz_bytes(data=array))

        # grid2op signs its metadata under its folder's path (less the env's: its statistics
        # live in the env's folder); a cache entry under its own name: one reached through a
        # link, or moved (a cache restored elsewhere), failed as "modified outside of grid2op",
        # after every episode of the score had played.
        def _get_hash_key_from_path(self, path_total: str) -> str:
            key: str = super()._get_hash_key_from_path(os.path.basename(path_total))
            return key

        # compute_stats processes the episodes in a private folder, renamed into place after:
        # grid2op's metadata name (and sign, with grid2op's key) the folder the statistics are
        # in, to be the final one.
        def _gather_all(self, li_episodes: Any, dict_metadata: Any, score_names: Any) -> None:
            super()._gather_all(li_episodes, dict_metadata, score_names)
            final = getattr(self, "final_path", None)
            if final is None or not li_episodes:
                return
            here = li_episodes[0][0]
            path = os.path.join(here, self.METADATA)
            with open(path, encoding="utf-8") as f:
                metadata = json.load(f)
            del metadata[self._get_hash_key_from_path(here)]
            for value in metadata.values():
                if isinstance(value, dict) and value.get("path") == here:
                    value["path"] = final
            signature = self._get_hash_from_json_metadata(metadata)
            metadata[self._get_hash_key_from_path(final)] = signature
            with open(path, "w", encoding="utf-8") as f:
                json.dump(obj=metadata, fp=f)

    env = scorer.env
    params = ref.parameters if ref.parameters is not None else env.parameters
    key = {
        "grid2op": grid2op.__version__,
        "score": type(scorer).__name__,
        "reference": ref.name,
        "agent": "DoNothingAgent" if ref.agent is None else type(ref.agent).__name__,
        "env": os.path.realpath(env.get_path_env()),
        # Everything the env was made with (its backend, rewards, opponent, chronics class,
        # thermal limits, ...): what workers build it from, as the runners' recipes key it.
        "env_key": env_key(env),
        # The scenarios played, in play order, and the files they and the env are read from.
        "played": data,
        "nb_scenario": int(scorer.nb_scenario),
        "max_step": int(scorer.max_step),
        "env_seeds": None if env_seeds is None else [int(s) for s in env_seeds],
        "agent_seeds": None if agent_seeds is None else [int(s) for s in agent_seeds],
        "parameters": params.to_dict(),  # the reference's own (env_key has the env's)
        "scores": str(scorer.scores_func),
    }
    digest = hashlib.blake2b(json.dumps(key, sort_keys=True).encode(), digest_size=12)
    stats = Stats(env, ref.name)
    # The env's name, for people looking in the cache, cut short (the digest tells entries
    # apart): an env folder's name of 215 characters made a name too long for the file system.
    name = env.env_name.encode()[:100].decode("utf-8", "ignore")
    folder = os.path.join(cache_root, f"{name}-{digest.hexdigest()}")
    stats.path_save_stats = os.path.join(folder, EpisodeStatistics.get_name_dir(ref.name))
    return stats


def _scored_env(env: Any, scorer: Any, parameters: Any, envs: dict[str, Any]) -> Any:
    """A copy of ``env`` with the competition's score functions as other rewards (as grid2op's
    ``EpisodeStatistics.run_env`` adds them) and ``parameters``; one per parametrisation."""
    from grid2op.Reward.rewardHelper import RewardHelper
    from grid2op.utils.underlying_statistics import EpisodeStatistics

    key = json.dumps(parameters.to_dict(), sort_keys=True)
    built = envs.get(key)
    if built is not None:
        return built
    scored = env.copy()
    funcs = scorer.scores_func
    named = (
        {EpisodeStatistics.KEY_SCORE: funcs}
        if not isinstance(funcs, dict)
        else {f"{EpisodeStatistics.KEY_SCORE}_{k}": v for k, v in funcs.items()}
    )
    try:
        for name, func in named.items():
            helper = RewardHelper(func, scored.logger)
            helper.initialize(scored)
            scored.other_rewards[name] = helper
    except BaseException:
        scored.close()
        raise
    if parameters.to_dict() != env.parameters.to_dict():
        # What grid2op's run_env gives its Runner (``parameters_path``): this copy is never
        # played, only read by the runner (``get_params_for_runner``), so no reset applies it
        # (one would re-read the chronic's files: half a second on l2rpn_idf_2023).
        scored._parameters = copy.deepcopy(parameters)
    envs[key] = scored
    return scored


def compute_stats(
    scorer: Any,
    ref: _Reference,
    played: str,
    episodes: Sequence[Any],
    env_seeds: Sequence[int] | None,
    agent_seeds: Sequence[int] | None,
) -> None:
    """grid2op's ``EpisodeStatistics.compute`` post-processing of the episodes in ``played``."""
    from grid2op.Agent import DoNothingAgent

    stats = ref.stats
    if _intact(stats.path_save_stats):
        return  # completed meanwhile
    with _privately(stats) as folder:
        # compute() rewrites the folder: copy this score's episodes there (path_save keeps them
        # whole) and process them in place. Each under its chronic's name, as grid2op's Runner
        # saves it: path_save may also hold an earlier run's episodes, and then this run's are
        # <chronic>_1, ...
        for entry in os.scandir(played):
            if entry.is_file():  # the spaces' descriptions
                shutil.copy2(entry.path, folder)
        for episode in episodes:
            shutil.copytree(episode.path, os.path.join(folder, episode.name))
        agent = ref.agent if ref.agent is not None else DoNothingAgent(scorer.env.action_space)
        stats.compute(
            agent=agent,
            parameters=ref.parameters,
            nb_scenario=len(episodes),
            scores_func=scorer.scores_func,
            max_step=scorer.max_step,
            env_seeds=env_seeds,
            agent_seeds=agent_seeds,
        )
        stats.clear_episode_data()
        sizes = {e.name: e.stat().st_size for e in os.scandir(folder) if e.is_file()}
        with open(os.path.join(folder, _COMPLETE), "w", encoding="utf-8") as f:
            json.dump({"written_by": "asyncrunner.score", "sizes": sizes}, f)


def _intact(folder: str) -> bool:
    """Whether ``folder`` is a cache entry written whole, every file as it was written (a
    file lost, or an entry of an older version, is computed again: it failed the score after
    its episodes had played)."""
    try:
        with open(os.path.join(folder, _COMPLETE), encoding="utf-8") as f:
            sizes = json.load(f)["sizes"]
        return all(os.path.getsize(os.path.join(folder, n)) == s for n, s in sizes.items())
    except (OSError, ValueError, KeyError, TypeError):
        return False


@contextlib.contextmanager
def _privately(stats: Any) -> Iterator[str]:
    """``stats``' cache folder written in a private folder beside it, renamed into place once
    the block ends without an error.

    Another process (or thread) may compute the same cache entry at once: each works in its own
    folder and renames it into place, complete; the first one there wins, the others drop theirs
    and read it. A complete entry is never removed."""
    target = stats.path_save_stats
    parent, base = os.path.split(target)
    os.makedirs(parent, exist_ok=True)
    # Unique to this call (mkdir fails on an existing name), as the umask allows (not mkdtemp's).
    private = os.path.join(parent, f".{base}.{os.getpid()}.{secrets.token_hex(6)}")
    os.mkdir(private)
    try:
        stats.final_path = target
        stats.path_save_stats = private
        try:
            yield private
        finally:
            stats.path_save_stats = target
            del stats.final_path
        _move_into_place(private, target)
    finally:
        shutil.rmtree(private, ignore_errors=True)  # left only when it did not go in place


def _move_into_place(private: str, target: str) -> None:
    """Renames the complete folder ``private`` to ``target`` (atomic), unless ``target`` is
    complete already (another process's, which readers may be using: ``private`` is left for the
    caller to remove). An incomplete ``target`` (damaged: a crash, a copy cut short, a file
    lost) is replaced. Under a lock on the cache folder, so that no process moves aside what
    another has just renamed into place."""
    parent, base = os.path.split(target)
    with _locked(parent):
        if _intact(target):
            return
        if os.path.lexists(target):
            aside = tempfile.mkdtemp(prefix=f".{base}.{os.getpid()}.damaged.", dir=parent)
            try:
                os.rename(target, os.path.join(aside, base))
            finally:
                shutil.rmtree(aside, ignore_errors=True)
        os.rename(private, target)


@contextlib.contextmanager
def _locked(folder: str) -> Iterator[None]:
    """An exclusive lock on ``folder`` between processes (none where there is no ``flock``)."""
    try:
        import fcntl
    except ImportError:  # Windows: renaming onto a folder fails there anyway
        yield
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def grid2op_scores(scorer: Any, episodes: Sequence[Any]) -> tuple[tuple[Any, ...], list[Any]]:
    """``get``'s loop over the scenarios, on the agent's saved episodes (grid2op reads the same
    two files from the folders its Runner saves), and those episodes in its order: the
    references' statistics' (their folders' names sorted: ``chronics@10`` before
    ``chronics@2``), each agent episode the one of that chronic (grid2op's Runner saves it in
    the folder of its name; here an earlier score's in the same folder makes it ``<name>_1``)."""
    from grid2op.Episode import EpisodeData

    meta_dn = scorer.stat_dn.get_metadata()
    meta_rp = scorer.stat_no_overflow_rp.get_metadata()
    by_name = {e.name: e for e in episodes}
    ordered = [by_name[meta_dn[str(i)]["scenario_name"]] for i in range(int(scorer.nb_scenario))]
    all_scores, ts_survived, total_ts = [], [], []
    for ep_id, episode in enumerate(ordered):
        folder = episode.path
        with open(os.path.join(folder, EpisodeData.META_FILE), encoding="utf-8") as f:
            meta = json.load(f)
        with open(os.path.join(folder, EpisodeData.OTHER_REWARDS_FILE), encoding="utf-8") as f:
            other_rewards = json.load(f)
        value, survived, total = scorer._compute_episode_score(
            ep_id,
            meta=meta,
            other_rewards=other_rewards,
            dn_metadata=meta_dn,
            no_ov_metadata=meta_rp,
        )
        all_scores.append(value)
        ts_survived.append(survived)
        total_ts.append(total)
    return (all_scores, ts_survived, total_ts), ordered
