"""The sinks ``compat.Runner`` adds: grid2op's overwriting saves, its logs, its reward sums."""

from __future__ import annotations

import errno
import logging
import os
import secrets

from .._model import EpisodeFailed, EpisodeFinished, Event
from .._plan._layout import sync
from ..sinks import CompactEpisodeWriter, EpisodeDataWriter
from ..sinks._base import Sink

__all__ = ["EpisodeLog", "Failures", "ReplacingCompactWriter", "ReplacingWriter", "Sums"]


class ReplacingWriter(EpisodeDataWriter):
    """grid2op's saving: an episode's files replace those of the folder of its chronic's name
    (atomically); what else that folder holds (a replay's ``.gif``, your notes) is kept, as
    grid2op, which writes its files over the old ones, keeps it."""

    def _move_into_place(self, folder: str, name: str, mix: str | None = None) -> str:
        if not name:
            return self._write_over(folder, self._folder(mix))
        target = os.path.join(self._folder(mix), name)
        if os.path.lexists(target) and not os.path.isdir(target):
            # A file of that name (yours): grid2op fails to write into it; never replace it.
            raise NotADirectoryError(errno.ENOTDIR, "Not a directory", target)
        aside = self._new_tmp(self.path)
        kept: list[str] = []  # the old folder's other entries, moved into the new one
        set_aside = False
        try:
            with self._lock:
                try:
                    if os.path.isdir(target) and not os.path.islink(target):
                        written = set(os.listdir(folder))
                        for entry in os.listdir(target):
                            if entry not in written:
                                os.rename(os.path.join(target, entry), os.path.join(folder, entry))
                                kept.append(entry)
                    if os.path.lexists(target):
                        os.rename(target, aside)
                        set_aside = True
                    os.rename(folder, target)
                except BaseException as exc:
                    # A full disk can fail a rename: what was moved goes back before ``folder``
                    # is removed, and what cannot is kept, the error says where.
                    stuck = self._put_back(target, aside if set_aside else None, folder, kept)
                    if stuck:
                        exc.add_note(
                            f"what could not be put back in {target} is kept in " + ", ".join(stuck)
                        )
                    raise
                if kept:
                    sync([target])  # the entries moved in
        finally:
            self._remove([aside])
        return target

    def _write_over(self, folder: str, target: str) -> str:
        """A chronic without a name (``ChangeNothing``'s): grid2op writes its episode's files in
        ``path_save`` itself, over those there; each file is replaced whole."""
        with self._lock:
            for entry in os.listdir(folder):
                os.replace(os.path.join(folder, entry), os.path.join(target, entry))
        sync([target])
        return target

    def _put_back(self, target: str, aside: str | None, folder: str, kept: list[str]) -> list[str]:
        """Undo a replacement that failed midway: the old folder (set ``aside``) back to
        ``target``, the entries ``kept`` from it back from ``folder`` into it. Returns the folders
        that hold what could not go back, kept out of every removal."""
        stuck = []
        if aside is not None:
            try:
                os.rename(aside, target)
            except OSError:
                stuck.append(self._keep(aside, target))
        if aside is None or not stuck:
            left = []
            for entry in kept:
                try:
                    os.rename(os.path.join(folder, entry), os.path.join(target, entry))
                except OSError:
                    left.append(entry)
            if left:
                stuck.append(self._keep(folder, target))
        elif kept:
            stuck.append(self._keep(folder, target))  # no old folder in place to go back in
        return stuck

    def _keep(self, path: str, target: str) -> str:
        """``path`` under a hidden name beside ``target`` that no run removes (or where it is,
        spared by this writer if even that rename fails); returns where it is."""
        name = f".asyncrunner-kept-{os.path.basename(target)}-{secrets.token_hex(4)}"
        kept = os.path.join(os.path.dirname(target), name)
        try:
            os.rename(path, kept)
        except OSError:
            self._spare(path)
            return path
        return kept


class ReplacingCompactWriter(CompactEpisodeWriter):
    """grid2op's compact saving: an episode replaces the files of its chronic's name."""

    def _move_into_place(
        self, tmp_meta: str, tmp_npz: str, name: str, mix: str | None = None
    ) -> str:
        into = self._folder(mix)
        os.makedirs(into, exist_ok=True)
        meta_path = os.path.join(into, f"{name}_metadata.json")
        npz_path = os.path.join(into, f"{name}.npz")
        with self._lock:
            os.replace(tmp_meta, meta_path)
            os.replace(tmp_npz, npz_path)
        return npz_path


class Sums(Sink):
    """Each finished episode's reward sums, as grid2op's Runner returns them: numpy's type of
    its sum, and ``CompactEpisodeData``'s float64 one (``EpisodeFinished``)."""

    needs_steps = False

    def __init__(self) -> None:
        self.sums: dict[int, tuple[str, float]] = {}

    async def send(self, event: Event) -> None:
        if isinstance(event, EpisodeFinished):
            self.sums[event.index] = (event.cum_reward_type, event.cum_reward64)


class Failures(Sink):
    """The episodes' failures (for good: not a dead worker's retried attempt), as they came."""

    needs_steps = False

    def __init__(self) -> None:
        self.events: list[EpisodeFailed] = []

    @property
    def order(self) -> dict[int, int]:
        """Each failed episode's place among the failures."""
        return {event.index: k for k, event in enumerate(self.events)}

    async def send(self, event: Event) -> None:
        if isinstance(event, EpisodeFailed) and not event.retrying:
            self.events.append(event)


class EpisodeLog(Sink):
    """Each finished episode's record on the runner's logger, as grid2op's Runner logs it
    (``aux_fun._aux_run_one_episode``: the env's and the agent's times, the reward)."""

    needs_steps = False

    def __init__(self, logger: logging.Logger) -> None:
        self.logger = logger

    async def send(self, event: Event) -> None:
        if isinstance(event, EpisodeFinished) and self.logger.isEnabledFor(logging.INFO):
            env, times = event.times["Env"], event.times
            self.logger.info(
                "\n".join(
                    (
                        f"Env: {env['total']:.2f}s",
                        f"\t - apply act {env['apply_act']:.2f}s",
                        f"\t - run pf: {env['powerflow_computation']:.2f}s",
                        f"\t - env update + observation: {env['observation_computation']:.2f}s",
                        f"Agent: {times['Agent']['total']:.2f}s",
                        f"Total time: {times['total']:.2f}s",
                        f"Cumulative reward: {event.cum_reward:1f}",
                    )
                )
            )
