"""``OnlyMix``: one sink per mix of a ``MultiMixEnvironment`` (its own ``path_save/<mix>``)."""

from __future__ import annotations

from collections.abc import Mapping

from .._model import Event
from ._base import Sink

__all__ = ["OnlyMix"]


class OnlyMix(Sink):
    """Passes ``sink`` the run-level events and the events of one mix's episodes."""

    def __init__(self, sink: Sink, mix: str, mix_of: Mapping[int, str | None]) -> None:
        self.sink = sink
        self.mix = mix
        self._mix_of = mix_of
        self.needs_steps = sink.needs_steps
        self.episode_format = sink.episode_format

    def __repr__(self) -> str:
        return f"OnlyMix({self.sink!r}, {self.mix!r})"

    @property
    def saved(self) -> Mapping[int, str]:
        return self.sink.saved

    async def send(self, event: Event) -> None:
        index = getattr(event, "index", None)
        if index is None or self._mix_of.get(index) == self.mix:
            await self.sink.send(event)

    async def aclose(self) -> None:
        await self.sink.aclose()
