"""The sinks ``compat.Runner`` adds: grid2op's overwriting saves, float64 reward sums."""

from __future__ import annotations

import os

from .._model import EpisodeStarted, Event, StepBatch
from .._plan._layout import sync
from ..sinks import CompactEpisodeWriter, EpisodeDataWriter
from ..sinks._base import Sink

__all__ = ["ReplacingCompactWriter", "ReplacingWriter", "Sum64"]


class ReplacingWriter(EpisodeDataWriter):
    """grid2op's saving: an episode's files replace those of the folder of its chronic's name
    (atomically); what else that folder holds (a replay's ``.gif``, your notes) is kept, as
    grid2op, which writes its files over the old ones, keeps it."""

    def _move_into_place(self, folder: str, name: str) -> str:
        target = os.path.join(self.path, name)
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
                except BaseException:
                    # A full disk can fail a rename: the old folder and the entries kept in it go
                    # back (renamed back where they were), before ``folder`` is removed.
                    if set_aside:
                        os.rename(aside, target)
                    for entry in kept:
                        os.rename(os.path.join(folder, entry), os.path.join(target, entry))
                    raise
                if kept:
                    sync([target])  # the entries moved in
        finally:
            self._remove([aside])
        return target


class ReplacingCompactWriter(CompactEpisodeWriter):
    """grid2op's compact saving: an episode replaces the files of its chronic's name."""

    def _move_into_place(self, tmp_meta: str, tmp_npz: str, name: str) -> str:
        meta_path = os.path.join(self.folder, f"{name}_metadata.json")
        npz_path = os.path.join(self.folder, f"{name}.npz")
        with self._lock:
            os.replace(tmp_meta, meta_path)
            os.replace(tmp_npz, npz_path)
        return npz_path


class Sum64(Sink):
    """Each episode's cumulative reward summed in float64, as ``CompactEpisodeData`` sums it."""

    needs_steps = False

    def __init__(self) -> None:
        self.sums: dict[int, float] = {}
        self._attempts: dict[int, int] = {}

    async def send(self, event: Event) -> None:
        if isinstance(event, StepBatch):
            if self._attempts.get(event.index) == event.attempt:
                total = self.sums[event.index]
                for reward in event.rewards.tolist():
                    total += float(reward)
                self.sums[event.index] = total
        elif isinstance(event, EpisodeStarted):
            self.sums[event.index] = 0.0
            self._attempts[event.index] = event.attempt
