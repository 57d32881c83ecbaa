"""One run: hands episode requests to free workers, collects their events, fans them out to sinks.

Task layout (all inside ``execute``)::

    channel listener ── inbox ──> collector (this task) ──> one bounded stream per sink ──> sink task
    dispatcher × workers: take the next request, call the worker, wait for its terminal event

Episodes are handed out one at a time: a dispatcher that finishes takes the next request.
"""

from __future__ import annotations

import asyncio
import math
import secrets
import threading
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any, Literal

import anyio
import numpy as np
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from .._exceptions import EpisodeError, SinkError, leaves
from .._model import (
    STOPPED,
    EpisodeFailed,
    EpisodeFinished,
    EpisodeRequest,
    EpisodeResult,
    EpisodeStarted,
    Event,
    RunFinished,
    RunStarted,
    StepBatch,
)
from ..sinks._base import Sink
from ..sinks._writer import Writer
from ._central import CentralAgent, serving
from ._channel import Channel, open_channel, receive_soon, send_soon
from ._pool import WorkerDied, WorkerPool, on_trio
from ._recipe import EpisodeJob

__all__ = ["Run", "RunSettings"]

# Events a sink may have waiting before the run waits for it (backpressure).
SINK_BUFFER = 32
# Seconds the sinks get to finish their events and close once the run stopped (a sink failed,
# the caller cancelled): a sink stuck in its ``send`` or ``aclose`` would otherwise hold the
# failure or the cancellation back for ever.
SINK_DRAIN_GRACE = 30.0


@dataclass(frozen=True)
class RunSettings:
    """How one run plays its requests, checked by ``AsyncRunner``.

    ``recipes``: each mix's pickled env and agent recipe, ``(key, bytes)``; ``agent``: the
    agent's recorded name; ``central``: the ``CentralAgent`` serving the workers, if any;
    ``env_for(mix)``: the parent's env of a mix; ``spaces``, ``space_files``: ``RunStarted``'s;
    ``detail``:
    whether the workers send the steps' arrays; ``files``: the episode file formats they build
    (``Sink.episode_format``); ``objects``: whether they send the steps' grid2op objects
    (``EpisodeFinished.objects``); ``exceptions``: whether a failure's exception comes back pickled
    (``EpisodeFailed.exception``); ``record``: whether the workers read each step's agent's action
    and opponent's attack with grid2op's ``to_vect``, as grid2op's Runner does whenever it
    records an episode (``EpisodeData.incr_store``): that call builds the attributes
    an action builds on first read, and an action read so plays differently afterwards on some
    envs (on an env with ``allow_detachment=True``, an action whose detachment arrays are not
    built counts every substation with a load as changed: more actions are illegal).
    """

    sinks: Sequence[Sink]
    on_error: Literal["raise", "continue"]
    retries: int
    episode_timeout: float | None
    detail: bool
    recipes: Mapping[str | None, tuple[str, bytes]]
    agent: str | None
    central: CentralAgent | None
    env_for: Callable[[str | None], Any]
    spaces: Mapping[str, Any]
    space_files: Mapping[str, bytes]
    files: tuple[str, ...] = ()
    objects: bool = False
    record: bool = True
    exceptions: bool = False


class Run:
    """The state of one ``run()`` / ``stream()`` call: ``requests`` played on ``pool``."""

    def __init__(
        self,
        pool: WorkerPool,
        requests: Sequence[EpisodeRequest],
        settings: RunSettings,
        *,
        skipped: Sequence[EpisodeResult] = (),
    ) -> None:
        self.pool = pool
        self.requests = list(requests)
        self._by_index = {r.index: r for r in self.requests}
        self.settings = settings
        self.sinks = list(settings.sinks)
        self.on_error = settings.on_error
        self.retries = settings.retries
        self.episode_timeout = settings.episode_timeout
        self.detail = settings.detail
        self.run_id = secrets.token_hex(6)
        self.results: dict[int, EpisodeResult] = {r.index: r for r in skipped}
        self.failure: EpisodeFailed | None = None
        self._terminal: dict[tuple[int, int], anyio.Event] = {}
        self._closed: set[tuple[int, int]] = set()
        self._last_step: dict[tuple[int, int], int] = {}  # by (index, attempt): received
        # The failures the orchestrator made (a dead worker, a timeout), by (index, attempt), with
        # their message given the step: sent through the inbox behind that attempt's events still
        # queued there, they get their step when collected, once those went to the sinks.
        self._made: dict[tuple[int, int], tuple[EpisodeFailed, Callable[[int], str]]] = {}
        # Each episode's last start: a failed episode's result names its chronic and length.
        self._started: dict[int, EpisodeStarted] = {}
        self._watchdogs: dict[tuple[int, int], anyio.CancelScope] = {}
        self._remaining = len(self.requests)
        self._agent: Any = None  # the CentralAgent's server during execute, if any
        # Where the workers write the files, by format (``_make_stages``).
        self._stages: dict[str, str] = {}
        self._stop_playing: Callable[[], None] | None = None  # once the sinks are started
        self.stopped = False  # by ``stop``
        self.cut: list[Sink] = []  # the sinks the grace cut short (``_Closes.cut``)

    def stop(self) -> bool:
        """Stop playing (the runner closing): the sinks finish the events they were given (a
        writer places the episodes that finished) within ``SINK_DRAIN_GRACE``, and ``execute``
        returns with ``stopped`` set. False before the sinks started: nothing was given to them,
        the caller cancels the run."""
        if self._stop_playing is None:
            return False
        self.stopped = True
        self._stop_playing()
        return True

    async def execute(
        self, out: MemoryObjectSendStream[Event] | None = None
    ) -> list[EpisodeResult]:
        """Play every request; returns the results in request order (raises under ``"raise"``)."""
        with _one_run_each(self.sinks):
            return await self._execute(out)

    async def _execute(self, out: MemoryObjectSendStream[Event] | None) -> list[EpisodeResult]:
        sink_sends: list[MemoryObjectSendStream[Event]] = []
        # A sink failing stops the run (``playing``), not the other sinks: they finish the
        # events they were given (a writer saves the episodes it got), then close.
        sink_errors: list[SinkError] = []
        playing = anyio.CancelScope()
        closes = _Closes(len(self.sinks), sink_errors)
        self.cut = closes.cut
        ended: RunFinished | None = None

        def stop_playing() -> None:  # a sink failed, or ``stop``
            playing.cancel()
            scope = sink_group.cancel_scope
            scope.deadline = min(scope.deadline, anyio.current_time() + SINK_DRAIN_GRACE)
            closes.hurry()

        async with (
            open_channel(listen=self.pool.listen) as channel,
            serving(self.settings.central, channel, self._env_of) as self._agent,
        ):
            channel.pids = self.pool.served  # the workers say who they are when they connect
            channel.recipes = dict(self.settings.recipes.values())
            try:
                try:
                    async with anyio.create_task_group() as sink_group:
                        for sink in self.sinks:
                            send, receive = anyio.create_memory_object_stream[Event](SINK_BUFFER)
                            sink_sends.append(send)
                            sink_group.start_soon(
                                _consume, sink, receive, sink_errors, stop_playing, closes
                            )
                        self._stop_playing = stop_playing
                        targets = [
                            (send, sink.episode_format is not None)
                            for send, sink in zip(sink_sends, self.sinks, strict=True)
                        ]
                        to_sinks = _fan_out(targets)
                        emit = to_sinks if out is None else _fan_out([*targets, (out, False)])
                        with closes:
                            with playing:
                                self._stages = await self._make_stages()
                                settings = self.settings
                                await emit(
                                    RunStarted(
                                        self.run_id,
                                        len(self.requests),
                                        settings.spaces,
                                        settings.agent,
                                        settings.space_files,
                                        tuple(m for m in settings.recipes if m is not None),
                                    )
                                )
                                await self._dispatch_and_collect(channel, emit)
                                ended = RunFinished(self.run_id, tuple(self._ordered()))
                                await to_sinks(ended)
                            for send in sink_sends:
                                await send.aclose()
                            await closes.all_done.wait()
                            self._stop_playing = None  # (the sinks are done: ``stop`` cancels)
                            if out is not None and not sink_errors and ended is not None:
                                # The stream's once the writers placed the files: with paths.
                                placed = tuple(self._with_paths(list(ended.results)))
                                await send_soon(out, replace(ended, results=placed))
                except anyio.get_cancelled_exc_class():
                    # Cancelled (a timeout, a stream left) while the other sinks drained: the
                    # sink's failure came first, and is what the caller needs to know.
                    if sink_errors:
                        raise _first_failure(sink_errors) from None
                    raise
                if sink_errors:
                    raise _first_failure(sink_errors)
            except* SinkError as failed:
                # As EpisodeError does: what was played stays known (and saved, where it was).
                finished = [r for r in self._with_paths(self._ordered()) if r.error is None]
                # nested in the task groups' exception groups
                for exc in [e for e in leaves(failed) if isinstance(e, SinkError)]:
                    exc.results = finished
                raise
            finally:
                self._stop_playing = None
                for send in sink_sends:
                    send.close()
        results = self._with_paths(self._ordered())
        if self.failure is not None and self.on_error == "raise":
            raise EpisodeError(
                self.failure,
                [r for r in results if r.error is None],
                self.results[self.failure.index],
            )
        return results

    async def _make_stages(self) -> dict[str, str]:
        """Where the workers write each format's files themselves (``Writer.stage``), by
        format: when they run on this machine (the channel is a Unix socket) and one writer
        saves that format."""
        stages: dict[str, str] = {}
        if self.pool.listen is not None:
            return stages  # workers elsewhere: the files travel with EpisodeFinished
        for fmt in self.settings.files:
            writers = [s for s in self.sinks if s.episode_format == fmt]
            if len(writers) != 1 or not isinstance(writers[0], Writer):
                continue  # two writers would get one episode's files; a sink of its own
            try:
                stages[fmt] = await anyio.to_thread.run_sync(writers[0].stager())
            except OSError:
                pass  # the writer writes the files, and says why it cannot
        return stages

    def _env_of(self, index: int) -> Any:
        return self.settings.env_for(self._by_index[index].mix)

    def _ordered(self) -> list[EpisodeResult]:
        return [self.results[i] for i in sorted(self.results)]

    def _with_paths(self, results: list[EpisodeResult]) -> list[EpisodeResult]:
        paths: dict[int, str] = {}
        for sink in self.sinks:
            paths.update(sink.saved)
        return [replace(r, path=paths.get(r.index, r.path)) for r in results]

    async def _dispatch_and_collect(
        self, channel: Channel, emit: Callable[[Event], Awaitable[None]]
    ) -> None:
        if not self.requests:
            return
        send, receive = anyio.create_memory_object_stream[EpisodeRequest](len(self.requests))
        for request in self.requests:
            send.send_nowait(request)
        send.close()
        async with anyio.create_task_group() as dispatchers, receive:
            for _ in range(min(self.pool.workers, len(self.requests))):
                dispatchers.start_soon(self._dispatch, receive.clone(), channel)
            while True:
                try:
                    event = await receive_soon(channel.receive)
                except anyio.EndOfStream:
                    break
                await self._collect(event, emit)
                if self.failure is not None and self.on_error == "raise":
                    # Stop the rest: cancelling a call stops its worker process.
                    dispatchers.cancel_scope.cancel()
                    break
                if self._remaining == 0:
                    break  # the dispatchers return on their own (cancelling would kill workers)
        if self.failure is not None and self.on_error == "raise":
            await self._end_stopped(emit)

    async def _end_stopped(self, emit: Callable[[Event], Awaitable[None]]) -> None:
        """The episodes still playing when the first failure stopped the run end with an
        ``EpisodeFailed`` too: every ``EpisodeStarted`` has its end (they get no result)."""
        assert self.failure is not None
        for index, started in list(self._started.items()):
            key = (index, started.attempt)
            if key in self._closed or index in self.results:
                continue
            self._closed.add(key)
            await emit(
                EpisodeFailed(
                    run_id=self.run_id,
                    index=index,
                    attempt=started.attempt,
                    error_type=STOPPED,
                    message=f"stopped: episode {self.failure.index} failed first, and "
                    'on_error="raise" stops the run there',
                    traceback="",
                    step=self._last_step.get(key, 0),
                    steps_lost=True,
                )
            )

    async def _collect(self, event: Any, emit: Callable[[Event], Awaitable[None]]) -> None:
        if event.run_id != self.run_id:
            return
        key = (event.index, event.attempt)
        if key in self._closed:
            self._made.pop(key, None)
            return  # late frames of an attempt already ended (its worker died)
        if isinstance(event, EpisodeStarted | StepBatch):
            _read_only(event)  # every sink gets this one object: none may change it for others
        if isinstance(event, EpisodeStarted):
            self._started[event.index] = event
            watchdog = self._watchdogs.get(key)
            if watchdog is not None and self.episode_timeout is not None:
                watchdog.deadline = anyio.current_time() + self.episode_timeout
        elif isinstance(event, StepBatch):
            self._last_step[key] = event.first_step + len(event) - 1
        elif isinstance(event, EpisodeFinished):
            self._closed.add(key)
            mix = self._by_index[event.index].mix
            self.results[event.index] = EpisodeResult.of_finished(event, mix=mix)
            self._remaining -= 1
        elif isinstance(event, EpisodeFailed):
            event = self._completed(key, event)
            self._closed.add(key)
            if not event.retrying:
                request = self._by_index[event.index]
                self.results[event.index] = EpisodeResult.of_failed(
                    event,
                    self._started.get(event.index),
                    env_seed=request.env_seed,
                    agent_seed=request.agent_seed,
                    mix=request.mix,
                    name=request.chronic,
                )
                self._remaining -= 1
                if self.failure is None:
                    self.failure = event
        else:
            return
        await emit(event)
        if key in self._closed:
            self._ended(key)

    def _completed(self, key: tuple[int, int], event: EpisodeFailed) -> EpisodeFailed:
        """``event``, if the orchestrator made it (``_fail``), with the step received when it
        is collected: every batch of the attempt before it in the inbox went to the sinks, and
        those after it are dropped (``_closed``), so the sinks got the steps up to that one."""
        made = self._made.pop(key, None)
        if made is None or made[0] is not event:
            return event  # the worker's own (its step is where it failed)
        step = self._last_step.get(key, 0)
        started = self._started.get(event.index)
        return replace(
            event,
            step=step,
            message=made[1](step),
            # (an attempt that never started played no step)
            steps_lost=started is not None and started.attempt == key[1],
        )

    def _ended(self, key: tuple[int, int]) -> None:
        if self._agent is not None:
            self._agent.forget(key)
        self._terminal.setdefault(key, anyio.Event()).set()

    async def _dispatch(
        self, requests: MemoryObjectReceiveStream[EpisodeRequest], channel: Channel
    ) -> None:
        central = self.settings.central
        per_worker = 1
        if central is not None and self.pool.groups_episodes:
            per_worker = central.envs_per_worker
        async with requests:
            while True:
                try:
                    request = await receive_soon(requests)
                except anyio.EndOfStream:
                    break
                group = [request]
                # Share the run among the workers rather than fill the first ones (and leave
                # a last, smaller group to play alone at the end).
                size = min(per_worker, -(-len(self.requests) // self.pool.workers))
                while len(group) < size:
                    try:
                        group.append(requests.receive_nowait())
                    except (anyio.WouldBlock, anyio.EndOfStream):
                        break
                await self._play(group, channel)

    def _job(self, request: EpisodeRequest, attempt: int, channel: Channel) -> EpisodeJob:
        return EpisodeJob(
            address=channel.address,
            token=channel.token,
            run_id=self.run_id,
            recipe_key=self.settings.recipes[request.mix][0],
            index=request.index,
            attempt=attempt,
            episode_id=request.episode_id,
            env_seed=request.env_seed,
            agent_seed=request.agent_seed,
            max_iter=request.max_iter,
            init_state=request.init_state,
            reset_options=request.reset_options,
            detail=self.detail,
            record=self.settings.record,
            exceptions=self.settings.exceptions,
            files=self.settings.files,
            objects=self.settings.objects,
            stages=self._stages,
            agent=self.settings.agent,
            mix=request.mix,
        )

    async def _play(self, group: list[EpisodeRequest], channel: Channel) -> None:
        """Play episodes in one worker call (several at once with ``envs_per_worker``) until
        each has ended.

        A timeout or a dead worker ends every episode of the group still playing; those the
        worker's death ended are retried together, each up to ``retries`` times. The timeout
        clock starts at EpisodeStarted (see _collect): a fresh worker's start and env build do
        not count against the episode.
        """
        attempts = dict.fromkeys((r.index for r in group), 1)
        while group:
            keys = [(r.index, attempts[r.index]) for r in group]
            terminals = [self._terminal.setdefault(key, anyio.Event()) for key in keys]
            jobs = [self._job(r, attempts[r.index], channel) for r in group]
            try:
                with anyio.CancelScope() as scope:
                    for key in keys:
                        self._watchdogs[key] = scope
                    await self.pool.play(jobs)
                if scope.cancelled_caught:
                    raise TimeoutError
            except TimeoutError:
                for request, key in zip(group, keys, strict=True):
                    if key not in self._closed:
                        timed_out = (
                            f"the episode ran longer than episode_timeout={self.episode_timeout}s;"
                            + (
                                " its worker was stopped"
                                if self.pool.stops_calls
                                else " this pool cannot interrupt a running task: the episode"
                                " stops at its next batch of steps, its worker busy until then"
                            )
                        )
                        await self._fail(
                            channel,
                            request,
                            key[1],
                            "EpisodeTimeout",
                            _as_is(timed_out),
                            retrying=False,
                        )
                return
            except Exception as exc:
                died = isinstance(exc, WorkerDied)
                error_type = exc.kind if isinstance(exc, WorkerDied) else type(exc).__name__
                detail = str(exc) or repr(exc)
                message = _died(detail, error_type) if died else _as_is(detail)
                ended = []
                for request, key in zip(group, keys, strict=True):
                    if key in self._closed:
                        continue
                    retrying = died and key[1] <= self.retries
                    await self._fail(channel, request, key[1], error_type, message, retrying)
                    if retrying:
                        ended.append((request, key))
                # A worker that died just after sending an attempt's end (its env's close, a
                # backend's teardown) left that end in the inbox ahead of the failure made here:
                # whichever the collector takes first ends the attempt, and only a failure is
                # played again (an episode is never played twice, nor a replay left unended).
                group = []
                for request, key in ended:
                    await self._terminal[key].wait()
                    if request.index not in self.results:
                        attempts[request.index] += 1
                        group.append(request)
                continue
            for terminal in terminals:
                if not terminal.is_set():  # its end usually came before the reply
                    await terminal.wait()
            return

    async def _fail(
        self,
        channel: Channel,
        request: EpisodeRequest,
        attempt: int,
        error_type: str,
        message: Callable[[int], str],
        retrying: bool,
    ) -> None:
        """End an attempt with an ``EpisodeFailed`` of the orchestrator's (``message``: its
        text given its step), put in the inbox behind the attempt's events still there: its
        step, the last one received, is the one collected before it (``_completed``)."""
        key = (request.index, attempt)
        failed = EpisodeFailed(
            run_id=self.run_id,
            index=request.index,
            attempt=attempt,
            error_type=error_type,
            message=message(0),
            traceback="",
            step=0,  # (``_completed`` sets it, and steps_lost)
            retrying=retrying,
        )
        self._made[key] = (failed, message)
        await channel.send.send(failed)


def _died(detail: str, kind: str) -> Callable[[int], str]:
    """The message of an attempt whose worker died (``kind``: the pool's error), or lost its
    connection to the runner (``ChannelClosed``), given the last step received from it."""
    what = (
        "process's connection to this runner failed" if kind == "ChannelClosed" else "process died"
    )

    def message(last: int) -> str:
        # A dead process cannot flush: the steps it played since its last batch are gone, so
        # say what was received, not where it died.
        seen = f"step {last} was the last received" if last else "no step received"
        return (
            f"the worker {what} ({detail}); {seen}: any steps it played after that "
            "were lost with it"
        )

    return message


def _as_is(detail: str) -> Callable[[int], str]:
    """A message that names no step."""
    return lambda _: detail


# The sinks serving a run now, by id: a sink's state is its run's (RunStarted starts it, aclose
# ends it), so a sink shared by two runs at once would mix them up (one writer saving one run's
# episode under the other's name).
_BUSY: set[int] = set()
_BUSY_LOCK = threading.Lock()


@contextmanager
def _one_run_each(sinks: Sequence[Sink]) -> Iterator[None]:
    sinks = [sink for sink in sinks if sink.one_run_at_a_time]
    ids = [id(sink) for sink in sinks]
    with _BUSY_LOCK:
        for i, sink in enumerate(sinks):
            if ids[i] in ids[:i]:
                raise RuntimeError(
                    f"sink {sink!r} is given twice to this run (in AsyncRunner(sinks=[...]) and "
                    "run(sinks=[...]), or twice in one list): give it once"
                )
            if ids[i] in _BUSY:
                raise RuntimeError(
                    f"sink {sink!r} is already serving a run: a sink serves one run at a time. "
                    "Give each run that overlaps another its own sinks (run(..., sinks=[...]), "
                    "path_save=...); AsyncRunner(sinks=[...]) suits runs played one after the "
                    "other"
                )
        _BUSY.update(ids)
    try:
        yield
    finally:
        with _BUSY_LOCK:
            _BUSY.difference_update(ids)


def _read_only(event: EpisodeStarted | StepBatch) -> None:
    for value in vars(event).values():
        if isinstance(value, np.ndarray):
            value.flags.writeable = False


def _fan_out(
    targets: Sequence[tuple[MemoryObjectSendStream[Event], bool]],
) -> Callable[[Event], Awaitable[None]]:
    """Send each event to every target; an episode's files only to those that write them (the
    others, ``stream()`` among them, could hold megabytes per episode without knowing it)."""

    async def emit(event: Event) -> None:
        bare = event
        if isinstance(event, EpisodeFinished) and event.files:
            bare = replace(event, files={})
        for target, writes in targets:
            await send_soon(target, event if writes else bare)

    return emit


class _Closes:
    """The sinks' closes: shielded from a cancellation (a writer still places the episodes it
    was given), each for ``SINK_DRAIN_GRACE`` seconds from the run's stop or its own start,
    whichever is later (``hurry``: a sink failed, or, leaving ``with``, the caller cancelled): a
    sink that never closes must not keep the caller for ever, and one still draining when the
    run stopped gets its grace to close. ``all_done`` is set once every sink's close is over;
    ``stopped_by``: the exception (the caller's cancellation) that left ``with`` while no sink
    had failed (``errors``: after one, the run's own grace ends it). ``stopping``: the run is
    stopping, or the task running it (asyncio's) was cancelled since the run began. ``cut``:
    the sinks whose events or close the grace cut short."""

    def __init__(self, count: int, errors: list[SinkError]) -> None:
        self.stopped_by: BaseException | None = None
        self._errors = errors
        self._hurried = False
        # (and how many cancellations it had then: one its caller swallowed stays counted)
        self._host = None if on_trio() else asyncio.current_task()
        self._calm = 0 if self._host is None else self._host.cancelling()
        self._scopes: set[anyio.CancelScope] = set()
        self._left = count
        self.cut: list[Sink] = []
        self.all_done = anyio.Event()
        if not count:
            self.all_done.set()

    @property
    def stopping(self) -> bool:
        return self._hurried or (self._host is not None and self._host.cancelling() > self._calm)

    def hurry(self) -> None:
        if not self._hurried:
            self._hurried = True
            for scope in self._scopes:
                scope.deadline = anyio.current_time() + SINK_DRAIN_GRACE

    def cut_short(self, sink: Sink) -> None:
        if all(other is not sink for other in self.cut):
            self.cut.append(sink)

    def __enter__(self) -> None:
        pass

    def __exit__(self, kind: object, exc: BaseException | None, tb: object) -> None:
        if exc is not None:
            if not self._errors:
                self.stopped_by = exc
            self.hurry()

    @contextmanager
    def shielded(self) -> Iterator[anyio.CancelScope]:
        deadline = anyio.current_time() + SINK_DRAIN_GRACE if self._hurried else math.inf
        with anyio.CancelScope(shield=True, deadline=deadline) as scope:
            self._scopes.add(scope)
            try:
                yield scope
            finally:
                self._scopes.discard(scope)
                self._left -= 1
                if not self._left:
                    self.all_done.set()


def _the_sinks_own(exc: BaseException, closes: _Closes) -> bool:
    """Whether ``exc`` is the sink's failure: an ``Exception``, or a cancellation no enclosing
    scope asked for (the sink awaited a future someone cancelled, or cancelled its own task),
    which would otherwise end the run early as if nothing had failed. Not while the run is
    stopping: asyncio may cancel every task itself (after a second Ctrl-C, ``asyncio.run``
    shuts down), which no scope asked for either."""
    if isinstance(exc, Exception):
        return True
    cancelled = isinstance(exc, anyio.get_cancelled_exc_class())
    return cancelled and not closes.stopping and anyio.current_effective_deadline() != -math.inf


def _first_failure(errors: list[SinkError]) -> SinkError:
    """The first sink failure, which stopped the run, told with the others."""
    for other in errors[1:]:
        errors[0].add_note(f"then {other}")
    return errors[0]


def _sink_error(sink: Sink, what: str, exc: BaseException) -> SinkError:
    error = SinkError(f"sink {sink!r} {what}: {type(exc).__name__}: {exc}", sink=sink)
    error.__cause__ = exc
    return error


async def _consume(
    sink: Sink,
    receive: MemoryObjectReceiveStream[Event],
    errors: list[SinkError],
    stop: Callable[[], None],
    closes: _Closes,
) -> None:
    """Hand ``sink`` its events, then close it. Its failure is added to ``errors`` and stops
    the run (``stop``); the events still coming are then dropped, so that the run never waits
    for it."""
    first: BaseException | None = None  # the caller's cancellation, if it came here
    failed: SinkError | None = None
    try:
        async with receive:
            while True:
                try:
                    event = await receive_soon(receive)
                except anyio.EndOfStream:
                    break
                except anyio.get_cancelled_exc_class() as exc:
                    # A sink that cancelled its own task and returned gets it here.
                    if not _the_sinks_own(exc, closes):
                        raise
                    if failed is None:
                        failed = _sink_error(sink, "cancelled its own task", exc)
                        errors.append(failed)
                        stop()
                    continue
                if failed is not None:
                    continue
                try:
                    await sink.send(event)
                except BaseException as exc:
                    if not _the_sinks_own(exc, closes):
                        raise
                    failed = _sink_error(sink, f"failed on {type(event).__name__}", exc)
                    errors.append(failed)
                    stop()
    except BaseException as exc:
        if not errors:  # (after a sink's failure, it is the run's own stop)
            first = exc
        if closes.stopping and isinstance(exc, anyio.get_cancelled_exc_class()):
            closes.cut_short(sink)  # (the grace, or the caller's cancellation)
        raise
    finally:
        closing = await _close(sink, closes)
        # A close failing on the caller's cancellation is told on it, not instead of it.
        told = failed or first or closes.stopped_by
        if closing is not None:
            if told is None:
                errors.append(_sink_error(sink, "failed closing (aclose)", closing))
            else:
                note = f"then sink {sink!r} failed closing: {type(closing).__name__}: {closing}"
                told.add_note(note)


async def _close(sink: Sink, closes: _Closes) -> BaseException | None:
    """``sink.aclose()`` (``closes.shielded``); what it raised of its own, if anything."""
    with closes.shielded() as shield:
        try:
            await sink.aclose()
        except BaseException as exc:
            if not _the_sinks_own(exc, closes):
                raise  # the grace is over (``shield`` takes it), or a KeyboardInterrupt
            return exc
    if shield.cancelled_caught:
        closes.cut_short(sink)
        return TimeoutError(f"still closing {SINK_DRAIN_GRACE:g} s after the run stopped")
    return None
