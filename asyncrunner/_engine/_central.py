"""Agents that live in the orchestrator: workers only step envs, the event loop answers with actions.

A worker whose run has a ``CentralAgent`` sends each observation as a vector over the run's
channel (``AgentCall``) and waits for the action. Here, per run, a ``_Server``:

- rebuilds the observation (``observation_space.from_vect``) unless the agent wants vectors;
- awaits an ``async`` agent on the event loop (many episodes wait on its I/O at once), and runs a
  sync one in a thread (``anyio.to_thread``) so CPU work never blocks the loop;
- for an agent with ``act_batch``, collects the observations of the episodes waiting at that
  moment into one call (dynamic batching): a batch leaves when it holds ``max_batch`` calls, when
  every episode in flight is in it, or ``max_wait`` seconds after its first call.
"""

from __future__ import annotations

import asyncio
import collections
import copy
import inspect
import numbers
import pickle
import threading
import traceback
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any, TypeGuard, TypeVar

import anyio
import numpy as np

from .._exceptions import text_of
from .._plan._arguments import at_least
from ._channel import AgentCall, Channel

T = TypeVar("T")

__all__ = ["CentralAgent", "is_async_agent", "serving"]

_Key = tuple[int, int]


def is_async_agent(agent: Any) -> bool:
    """Whether ``agent`` (a class or an instance) has an ``async def act`` or ``act_batch``."""
    return any(
        inspect.iscoroutinefunction(getattr(agent, name, None)) for name in ("act", "act_batch")
    )


class CentralAgent:
    """Runs ``agent`` in the orchestrator's process; workers only step envs.

    Pass it as ``AsyncRunner(env, agent=CentralAgent(...))``. ``agent`` is one of:

    - an object with ``act_batch(observations, rewards, dones) -> actions`` (sync or
      ``async def``): one instance serves every episode of the run, with the observations of
      the episodes waiting at that moment in one call (at most ``max_batch``; the first call of a
      batch waits at most ``max_wait`` seconds for the others);
    - an object with ``act(observation, reward, done) -> action`` (sync or ``async def``): one
      instance serves every episode, one call per step (sync calls one at a time, in a thread;
      async calls concurrently on the event loop);
    - a ``BaseAgent`` subclass or a factory ``(action_space) -> agent``: one agent per episode,
      built here with a copy of the env's action space, seeded with the episode's agent seed
      and reset with its first observation, as in a worker (same seeds, same results, unless
      it draws from a process-wide generator, ``torch.manual_seed``'s or ``np.random``'s: the
      episodes playing here at once share it).

    A shared instance (the first two) keeps its state across episodes and is neither seeded
    nor reset by the runner. Observations are rebuilt from vectors (``from_vect``): their values
    are the worker's, but ``simulate`` and forecasts are not available; ``vectors=True`` passes
    the vectors themselves (``obs.to_vect()``; a 2-D array for ``act_batch``), which skips the
    rebuild. ``batch_sizes`` counts the batches made, by size.

    ``envs_per_worker``: episodes each worker process plays at once (one env and one thread
    each): while one waits for its action, another steps, so batches fill and an I/O-bound
    agent's waits overlap with fewer processes. A worker takes that many episodes together
    and is free again when the last one ends.
    """

    def __init__(
        self,
        agent: Any,
        *,
        max_batch: int = 32,
        max_wait: float = 0.005,
        vectors: bool = False,
        envs_per_worker: int = 1,
    ) -> None:
        max_batch = at_least("max_batch", max_batch, 1)
        envs_per_worker = at_least("envs_per_worker", envs_per_worker, 1)
        real = isinstance(max_wait, numbers.Real) and not isinstance(max_wait, bool)
        if not (real and max_wait >= 0):
            raise ValueError(f"`max_wait` must be a number of seconds >= 0, got {max_wait!r}")
        if isinstance(agent, type) or not (hasattr(agent, "act") or hasattr(agent, "act_batch")):
            if not callable(agent):
                raise TypeError(
                    "CentralAgent needs an object with act() or act_batch(), a BaseAgent "
                    f"subclass or a factory (action_space) -> agent, got {type(agent).__name__}"
                )
            self.kind = "per_episode"
        else:
            self.kind = "batch" if hasattr(agent, "act_batch") else "shared"
        self.agent = agent
        # A shared sync agent: one call at a time, whichever runs call it (taken in the call's
        # thread: a call abandoned by a timeout still holds it until it returns).
        self.lock = threading.Lock()
        self.max_batch = max_batch
        self.max_wait = float(max_wait)
        self.vectors = vectors
        self.envs_per_worker = envs_per_worker
        self.batch_sizes: collections.Counter[int] = collections.Counter()

    def __repr__(self) -> str:
        return f"CentralAgent({self.agent!r}, max_batch={self.max_batch}, max_wait={self.max_wait})"


class _Pending:
    __slots__ = ("call", "done", "reply")

    def __init__(self, call: AgentCall) -> None:
        self.call = call
        self.done = anyio.Event()
        self.reply = b""


def _ok(action: Any) -> bytes:
    return pickle.dumps(("ok", action.to_vect()), protocol=5)


def _not_the_agents(exc: BaseException) -> bool:
    """Whether ``exc``, raised where an agent's code ran on the event loop, stops the run rather
    than fail the episode (as in a worker: ``_worker._EPISODE_ERRORS``): a KeyboardInterrupt
    (there, maybe the user's Ctrl-C), and this task's own cancellation, not a CancelledError
    the agent's code raised."""
    if isinstance(exc, KeyboardInterrupt):
        return True
    if not isinstance(exc, anyio.get_cancelled_exc_class()):
        return False
    try:
        task = asyncio.current_task()
    except RuntimeError:  # trio: its Cancelled is only ever its own
        return True
    return task is None or task.cancelling() > 0


def _error(exc: BaseException) -> bytes:
    if isinstance(exc, _Raised):
        raised, tb = exc.raised, exc.tb
    else:
        raised, tb = exc, traceback.format_exc()
    text = text_of(raised)
    if type(raised).__name__ == "NoForecastAvailable":  # grid2op's: obs.simulate, forecasts
        text += (
            " (a CentralAgent's observations are rebuilt from vectors, without simulate or "
            "forecasts: give this agent to the workers, AsyncRunner(env, agent=...))"
        )
    return pickle.dumps(("error", type(raised).__name__, text, tb), protocol=5)


class _Raised(Exception):
    """What an agent's sync call raised that is no ``Exception`` (a ``CancelledError`` of its
    own asyncio code...), carried out of its thread: raised as it is, it would look like the
    cancellation of the run's task, or end the run."""

    def __init__(self, raised: BaseException, tb: str) -> None:
        super().__init__(raised)
        self.raised, self.tb = raised, tb


def _carried(fn: Callable[[], T]) -> Callable[[], T]:
    """``fn``, to run in a thread, raising ``_Raised`` for what is no ``Exception``."""

    def run() -> T:
        try:
            return fn()
        except Exception:
            raise
        except BaseException as exc:
            raise _Raised(exc, traceback.format_exc()) from None

    return run


class _Server:
    """A run's side of a ``CentralAgent``: answers the workers' ``AgentCall``s."""

    def __init__(self, central: CentralAgent, env_of: Callable[[int], Any]) -> None:
        self.central = central
        self.env_of = env_of  # the parent's env (or mix) of an episode index
        self.active: set[_Key] = set()
        self.agents: dict[_Key, Any] = {}
        self.ended: set[_Key] = set()  # attempts that will call no more
        # This run's calls of a shared sync agent wait for its lock in one thread at most, not
        # in threads of anyio's default pool (which the sinks and the runner need).
        self.calls = anyio.CapacityLimiter(1)
        # The batch calls; None: an episode ended (a batch waiting for it leaves without it).
        self.send, self.receive = anyio.create_memory_object_stream[_Pending | None](float("inf"))

    def forget(self, key: _Key) -> None:
        """The attempt ``key`` ended: it will call no more."""
        self.active.discard(key)
        self.ended.add(key)
        self.agents.pop(key, None)
        if self.central.kind == "batch":
            self.send.send_nowait(None)

    def _observation(self, call: AgentCall) -> Any:
        if self.central.vectors:
            return call.observation
        space = self.env_of(call.index).observation_space
        obs = space.from_vect(call.observation, check_legit=False)
        for name, value in call.extras.items():
            setattr(obs, name, value)
        return obs

    async def _observation_off_loop(self, call: AgentCall) -> Any:
        # Rebuilding an observation costs about a step (~1 ms): not on the event loop.
        if self.central.vectors:
            return call.observation
        return await anyio.to_thread.run_sync(self._observation, call)

    async def act(self, call: AgentCall) -> bytes:
        key = (call.index, call.attempt)
        if key in self.ended:  # a frame left from an attempt that ended: nobody waits for it
            return _error(RuntimeError("this episode attempt has ended"))
        self.active.add(key)
        try:
            kind = self.central.kind
            if kind == "batch":
                pending = _Pending(call)
                self.send.send_nowait(pending)
                await pending.done.wait()
                return pending.reply
            if kind == "per_episode":
                return _ok(await self._per_episode(key, call))
            agent = self.central.agent
            if inspect.iscoroutinefunction(agent.act):
                obs = await self._observation_off_loop(call)
                return _ok(await agent.act(obs, call.reward, call.done))

            def run() -> Any:
                obs = self._observation(call)
                with self.central.lock:
                    return agent.act(obs, call.reward, call.done)

            # Abandoned when the episode times out or the run is cancelled: a sync call
            # cannot be interrupted, and must not hold the run.
            return _ok(
                await anyio.to_thread.run_sync(
                    _carried(run), abandon_on_cancel=True, limiter=self.calls
                )
            )
        except BaseException as exc:
            if _not_the_agents(exc):
                raise
            return _error(exc)

    async def _per_episode(self, key: _Key, call: AgentCall) -> Any:
        def run() -> tuple[Any, Any]:
            # Built here, off the event loop (an agent loading its weights).
            agent = self.agents.get(key)
            if agent is None:
                space = copy.deepcopy(self.env_of(call.index).action_space)
                agent = self.central.agent(space)
                if key not in self.ended:  # (a build its episode's timeout abandoned)
                    self.agents[key] = agent
            obs = self._observation(call)
            if call.first:
                if call.agent_seed is not None:
                    agent.seed(call.agent_seed)
                agent.reset(obs)
            if inspect.iscoroutinefunction(agent.act):
                return agent, obs  # acts on the event loop
            return None, agent.act(obs, call.reward, call.done)

        agent, result = await anyio.to_thread.run_sync(_carried(run), abandon_on_cancel=True)
        return result if agent is None else await agent.act(result, call.reward, call.done)

    async def batches(self) -> None:
        """Form and play batches until cancelled."""
        central = self.central
        async for first in self.receive:
            if not self._wanted(first):
                continue
            batch = [first]
            # Wait for the episodes in flight (not longer than max_wait), then take what came;
            # an episode that ends meanwhile is no longer waited for.
            with anyio.move_on_after(central.max_wait):
                while len(batch) < min(central.max_batch, len(self.active)):
                    pending = await self.receive.receive()
                    if self._wanted(pending):
                        batch.append(pending)
            while len(batch) < central.max_batch:
                try:
                    pending = self.receive.receive_nowait()
                except anyio.WouldBlock:
                    break
                if self._wanted(pending):
                    batch.append(pending)
            batch = [p for p in batch if self._wanted(p)]  # (one may have ended meanwhile)
            if batch:
                await self._play(batch)

    def _wanted(self, pending: _Pending | None) -> TypeGuard[_Pending]:
        """Whether ``pending`` is a call to play: not an episode's end (None), nor the call of
        an attempt that ended while it waited in line (timed out, its worker died): the agent
        is not asked for an action nobody takes, and the live episodes' batches are not the
        smaller for it."""
        if pending is None:
            return False
        if (pending.call.index, pending.call.attempt) in self.ended:
            pending.reply = _error(RuntimeError("this episode attempt has ended"))
            pending.done.set()
            return False
        return True

    async def _play(self, batch: list[_Pending]) -> None:
        central, agent = self.central, self.central.agent
        calls = [p.call for p in batch]
        rewards = [c.reward for c in calls]
        dones = [c.done for c in calls]
        central.batch_sizes[len(batch)] += 1

        def observations() -> Any:
            if central.vectors:
                return np.stack([c.observation for c in calls])
            return [self._observation(c) for c in calls]

        def act_batch() -> Any:
            obs = observations()
            with central.lock:
                return agent.act_batch(obs, rewards, dones)

        try:
            if inspect.iscoroutinefunction(agent.act_batch):
                obs = await anyio.to_thread.run_sync(observations)
                actions = await agent.act_batch(obs, rewards, dones)
            else:
                actions = await anyio.to_thread.run_sync(
                    _carried(act_batch), abandon_on_cancel=True, limiter=self.calls
                )
            actions = list(actions)
            if len(actions) != len(batch):
                raise ValueError(
                    f"act_batch returned {len(actions)} actions for {len(batch)} observations"
                )
            replies: Sequence[bytes] = [_ok(a) for a in actions]
        except BaseException as exc:
            if _not_the_agents(exc):
                raise
            replies = [_error(exc)] * len(batch)
        for pending, reply in zip(batch, replies, strict=True):
            pending.reply = reply
            pending.done.set()


@asynccontextmanager
async def serving(
    central: CentralAgent | None, channel: Channel, env_of: Callable[[int], Any]
) -> AsyncIterator[_Server | None]:
    """Answer the channel's agent calls with ``central`` until the block exits."""
    if central is None:
        yield None
        return
    server = _Server(central, env_of)
    async with server.send, server.receive, anyio.create_task_group() as group:
        if central.kind == "batch":
            group.start_soon(server.batches)
        channel.agent = server.act
        try:
            yield server
        finally:
            channel.agent = None
            group.cancel_scope.cancel()
