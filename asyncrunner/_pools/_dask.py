"""Episodes as Dask tasks: ``AsyncRunner(env, agent=..., executor=client)``.

``executor`` may be a ``distributed.Client`` (asynchronous or not), a scheduler address
(``"tcp://HOST:PORT"``) or a ``DaskExecutor`` (to choose where the event channel listens, or to
start a ``LocalCluster``, whose scheduler, workers and dashboard listen on 127.0.0.1 only). Each
episode is one task (``pure=False``, ``retries=0``, a key naming the run, episode and attempt),
handed out as workers free up; Dask workers keep their process, so the worker-side env cache
(``_envs._ENVS``) serves every episode a worker plays.

Steps come back over the run's authenticated channel (``_channel``): a Unix socket when the
scheduler is on this machine, else TCP. Exactly-once per attempt: before playing, the task claims
its attempt on the channel; a task Dask re-runs after its worker died finds the attempt claimed
and returns at once, and our retry loop plays a new attempt (``WorkerLost``), so a step is never
doubled. Stopping: Dask cannot interrupt a running task, so a cancelled or timed-out episode has
its channel connection closed; its next send fails (``ChannelClosed``) and the task ends.

Awaiting: an asynchronous client's futures are awaited on the loop (asyncio only); a synchronous
client's are waited for in a thread, which works under asyncio and trio.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import ipaddress
import math
import socket
import struct
import time
import uuid
import warnings
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import anyio
import anyio.to_thread

from .._engine import _channel
from .._engine._pool import WorkerPool, on_trio
from .._engine._recipe import EpisodeJob
from .._engine._worker import run_episode

__all__ = ["DaskExecutor", "DaskPool", "WorkerLost", "as_dask"]

T = TypeVar("T")

_LOST = "lost"
# A task whose channel closed returns this and why, raised here (``ChannelClosed``): the runner
# closes it to stop the task (a cancelled or timed-out episode), which Dask would otherwise log
# on the worker as a failed computation, with its traceback.
_CLOSED = "channel closed: "
# Seconds between two looks at whether the client still has its scheduler, while a task runs.
_WATCH = 1.0
# What a worker must have as this process has it for its episodes to be grid2op's here: the
# same code (Python: the same minor version, for what goes by value).
_SAME_VERSIONS = ("asyncrunner", "grid2op", "lightsim2grid", "pandapower", "numpy", "pandas")


class WorkerLost(Exception):
    """The Dask worker playing an attempt died (Dask re-ran the task; we retry instead), or Dask
    cancelled the task (``client.restart()``)."""


class SchedulerLost(Exception):
    """The Dask client closed (it lost its scheduler and failed to reconnect, or was closed):
    its futures would never end."""


def _check_client(client: Any) -> None:
    if client.status in ("closing", "closed"):
        where = getattr(getattr(client, "scheduler", None), "address", None)  # None once closed
        raise SchedulerLost(
            f"the Dask client closed (it lost its scheduler{f' at {where}' if where else ''}, or "
            "was closed): this episode's result is lost; start the scheduler again (or pass an "
            "open client) and run again (resume=True keeps the episodes saved so far)"
        )


def _dask_episode(job: EpisodeJob) -> str:
    """Runs on a Dask worker: play ``job`` unless another execution already claimed it."""
    try:
        # (a claim that cannot reach the runner: Dask re-ran the task after the run ended, or
        # the worker cannot reach this machine; raised in the runner as it was here)
        if not _channel.claim(job.address, job.token, job.claim_key):
            return _LOST
        return run_episode(job)
    except _channel.ChannelClosed as exc:
        return _CLOSED + str(exc)


def _is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _host_of(address: str) -> str:
    rest = address.split("://", 1)[-1]
    if rest.startswith("["):
        return rest[1 : rest.index("]")]
    return rest.rsplit(":", 1)[0]


def default_listen(scheduler: str) -> str | None:
    """Where a run's channel listens for a cluster whose scheduler is at ``scheduler``.

    ``None`` (a Unix socket) when the scheduler is on this machine (its workers then are too, as
    for a ``LocalCluster``); else TCP on the interface this machine uses to reach it.
    """
    if scheduler.startswith("inproc://"):
        return None
    host = _host_of(scheduler)
    if _is_loopback(host):
        return None
    port = int(scheduler.rsplit(":", 1)[1]) if scheduler.count(":") >= 2 else 8786
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, port))  # UDP: no packet is sent, it only picks the route
        mine = str(s.getsockname()[0])
    return f"tcp://[{mine}]:0" if ":" in mine else f"tcp://{mine}:0"


def unreachable(address: str, timeout: float = 5.0) -> str | None:
    """Why no Dask scheduler can answer at ``address`` (nothing listens there, no such host,
    something that is no Dask scheduler), or None: a Dask scheduler greeted us, or the scheme is
    not TCP (left to Dask). Dask's client would retry until its connect timeout (30 s), at every
    call, and hangs at something that listens but never greets it (an HTTP server: the
    dashboard's port)."""
    scheme, _, rest = address.rpartition("://")
    if scheme not in ("", "tcp"):
        return None
    host, sep, port = rest.rpartition(":")
    if not sep or rest.endswith("]"):  # no port ("[::1]": an IPv6 address's own colons)
        host, port = rest, "8786"
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout) as conn:
            return _no_greeting(conn)
    except (OSError, ValueError) as exc:
        return getattr(exc, "strerror", None) or str(exc) or type(exc).__name__


def _no_greeting(conn: socket.socket) -> str | None:
    """Why what accepted ``conn`` is no Dask scheduler, or None: a scheduler greets each new
    connection at once with its handshake, one message of a few hundred bytes (its length as 8
    bytes, then that many; distributed.comm.tcp)."""
    try:
        head = _receive(conn, 8)
        (size,) = struct.unpack("Q", head)
        if size > _GREETING_MAX:
            return f"something answered {head!r}..., not a Dask scheduler's greeting"
        _receive(conn, size)
    except TimeoutError:
        return (
            "something listens there but does not greet as a Dask scheduler does: a "
            "dashboard's port?"
        )
    return None


_GREETING_MAX = 1 << 20


def _receive(conn: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            raise ConnectionResetError(0, "it closed the connection without a Dask greeting")
        data += chunk
    return data


# Seconds a scheduler without workers gets for one to join before the runner says so.
_WORKERS_AWAITED = 5.0
# Seconds a cluster of yours may have no worker mid-run before the runner says so: a restart
# (``client.restart()``, workers respawned) takes a few, and an asynchronous client's view of
# it is up to two seconds old.
_WORKERLESS_TOLD = 10.0


class DaskExecutor:
    """Runs episodes as tasks of a Dask cluster.

    ``client``: a ``distributed.Client`` (yours: not closed here) or a scheduler address (a client
    is opened and closed here). ``local_workers=N`` instead starts a ``LocalCluster`` of ``N``
    single-threaded worker processes on 127.0.0.1 (closed with the runner). ``listen``: where the
    run's event channel listens, ``"tcp://HOST:PORT"`` (``HOST`` must be reachable from the
    workers; port 0 picks a free one); default: a Unix socket when the scheduler is on this
    machine, else TCP on the interface that reaches the scheduler. The token sent to workers
    authenticates the connections; use a trusted network (traffic is not encrypted).
    """

    def __init__(
        self,
        client: Any = None,
        *,
        local_workers: int | None = None,
        listen: str | None = None,
    ) -> None:
        if (client is None) == (local_workers is None):
            raise ValueError("pass a Dask client or scheduler address, or local_workers=N")
        if local_workers is not None and (
            isinstance(local_workers, bool)
            or not isinstance(local_workers, int)
            or local_workers < 1
        ):
            raise ValueError(f"`local_workers` must be an integer >= 1, got {local_workers!r}")
        if isinstance(client, str) and "://" not in client and client.count(":") != 1:
            raise ValueError(f"a Dask scheduler address looks like tcp://HOST:PORT, got {client!r}")
        try:
            import distributed  # noqa: F401
        except ImportError as exc:
            raise ImportError(
                "running on Dask needs the distributed package: pip install 'asyncrunner[dask]'"
            ) from exc
        self._given = client
        self._local_workers = local_workers
        self._client: Any = None if isinstance(client, str) or client is None else client
        self._cluster: Any = None
        self._owned = self._client is None
        if self._client is not None and getattr(self._client, "status", None) in (
            "closing",
            "closed",
        ):
            raise ValueError("the Dask client is closed: pass an open one (or its address)")
        self._lock: anyio.Lock | None = None
        self._looked = -math.inf  # when ``_look`` last asked the scheduler how many workers
        self._workerless: float | None = None  # since when (time.time) it has had none; inf: told
        self._waits: anyio.CapacityLimiter | None = None
        if listen is None and isinstance(client, str):
            try:
                listen = default_listen(client if "://" in client else f"tcp://{client}")
            except OSError as exc:  # no such host, no route
                raise ConnectionError(self._no_scheduler(exc.strerror or str(exc))) from None
        elif listen is None and self._client is not None:
            listen = default_listen(str(self._client.scheduler.address))
        self.listen = listen

    def _no_scheduler(self, reason: str) -> str:
        return (
            f"no Dask scheduler reachable at {self._given} ({reason}): start one with `dask "
            "scheduler`, or pass the address it prints"
        )

    async def connect(self) -> None:
        """Connect to the cluster given (a local cluster starts with its first task):
        ``ConnectionError`` now when no scheduler answers at the address, not every episode failing
        after Dask's timeouts; ``RuntimeError`` when a worker has other versions of the packages
        that make the results (``_SAME_VERSIONS``)."""
        if self._given is None:
            return  # a local cluster: this process's packages
        client = await self._get_client()
        try:
            await self._check_versions(client)
        except BaseException:
            await self.aclose()  # a client opened here (yours stays open)
            raise

    async def _check_versions(self, client: Any) -> None:
        packages = list(_SAME_VERSIONS)

        async def call(fn: Callable[..., Any], *args: Any) -> Any:
            if client.asynchronous:
                return await fn(*args)
            return await anyio.to_thread.run_sync(lambda: fn(*args))

        versions = await call(lambda: client.get_versions(packages=packages))
        if not versions["workers"]:
            # Dask waits for workers (started beside the scheduler, or by a cluster scaling
            # up, they join a moment later): the run waited in silence when none came.
            try:
                await call(client.wait_for_workers, 1, _WORKERS_AWAITED)
            except TimeoutError:
                warnings.warn(
                    f"the Dask scheduler at {client.scheduler.address} has no workers: "
                    "episodes wait until one joins (start them with `dask worker "
                    f"{client.scheduler.address} --nthreads 1`)",
                    UserWarning,
                    stacklevel=2,
                )
                self._workerless = math.inf  # (told: not again while none has joined)
            else:
                versions = await call(lambda: client.get_versions(packages=packages))
        here = versions["client"]["packages"]
        differ: dict[tuple[str, str | None, str | None], list[str]] = {}  # workers, by version
        for worker, info in sorted(versions["workers"].items()):
            there = (info or {}).get("packages") or {}
            for name in ("python", *_SAME_VERSIONS):
                mine, theirs = here.get(name), there.get(name)
                if name == "python":
                    mine, theirs = (v and ".".join(v.split(".")[:2]) for v in (mine, theirs))
                if mine != theirs:
                    differ.setdefault((name, theirs, mine), []).append(worker)
        if differ:
            found = "; ".join(
                f"{name} {theirs} on {', '.join(workers[:3])}"
                + (f" and {len(workers) - 3} more" if len(workers) > 3 else "")
                + f" (here: {mine})"
                for (name, theirs, mine), workers in differ.items()
            )
            raise RuntimeError(
                f"Dask workers run other versions than this process: {found}. Install the same "
                "versions on the workers: an episode plays as grid2op's Runner plays it here "
                "only with the same code"
            )

    async def _get_client(self) -> Any:
        if self._client is not None:
            return self._client
        if self._lock is None:
            self._lock = anyio.Lock()
        async with self._lock:
            if self._client is not None:
                return self._client
            if isinstance(self._given, str):
                reason = await anyio.to_thread.run_sync(unreachable, self._given)
                if reason is not None:
                    raise ConnectionError(self._no_scheduler(reason))
            import distributed

            dist: Any = distributed  # untyped calls
            Client, LocalCluster = dist.Client, dist.LocalCluster

            asyncio = not on_trio()
            if self._local_workers is not None:
                options: dict[str, Any] = dict(
                    n_workers=self._local_workers,
                    threads_per_worker=1,
                    processes=True,
                    host="127.0.0.1",
                    # A local cluster's dashboard is for this machine only (":0" listens on every
                    # interface), on any free port: None still binds 8787
                    # (dask/distributed#8136), which another cluster may hold.
                    dashboard_address="127.0.0.1:0",
                )
                # Started whole (about a second), even when the runner closes meanwhile (a
                # cancelled warm-up): Dask cannot close a cluster half started, and its worker
                # processes would outlive the runner. Kept as it starts, for aclose to close.
                if asyncio:
                    self._cluster = LocalCluster(asynchronous=True, **options)
                    with anyio.CancelScope(shield=True):
                        await self._cluster
                else:

                    def start_cluster() -> None:
                        self._cluster = LocalCluster(**options)

                    await anyio.to_thread.run_sync(start_cluster)
                target: Any = self._cluster
            else:
                target = self._given
            if asyncio:
                self._client = await Client(target, asynchronous=True, set_as_default=False)
            else:
                self._client = await anyio.to_thread.run_sync(
                    lambda: Client(target, set_as_default=False)
                )
            return self._client

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` as a task."""
        key = f"asyncrunner-{getattr(fn, '__name__', 'call')}-{uuid.uuid4().hex}"
        result: T = await self._run(fn, args, key, claim=None)
        return result

    async def play(self, job: EpisodeJob) -> None:
        """Play one episode as a task, claimed, stopped and retried as above."""
        key = f"asyncrunner-{job.run_id}-{job.index}-{job.attempt}"
        claim = (job.address, job.claim_key)
        result = await self._run(_dask_episode, (job,), key, claim=claim)
        if result == _LOST:
            raise WorkerLost("the Dask worker playing this episode died")
        if result.startswith(_CLOSED):
            raise _channel.ChannelClosed(result.removeprefix(_CLOSED))

    async def _run(
        self,
        task: Callable[..., Any],
        args: tuple[Any, ...],
        key: str,
        claim: tuple[str, str] | None,
    ) -> Any:
        client = await self._get_client()
        if client.asynchronous and on_trio():
            raise RuntimeError(
                "an asynchronous Dask client lives on an asyncio loop: under trio, pass a "
                "synchronous Client or the scheduler's address"
            )
        _check_client(client)
        future = client.submit(task, *args, pure=False, key=key, retries=0)
        done = False
        try:
            # Dask leaves the future pending for ever when the client loses its scheduler:
            # look at the client now and then while waiting.
            look = functools.partial(self._look, client)
            if client.asynchronous:
                result = await _result(look, future)
            else:
                # A thread per episode playing, not from anyio's default pool: the sinks need
                # that one to finish (the runner bounds how many episodes play).
                if self._waits is None:
                    self._waits = anyio.CapacityLimiter(math.inf)
                result = await anyio.to_thread.run_sync(
                    _wait, look, future, abandon_on_cancel=True, limiter=self._waits
                )
            done = True
        except concurrent.futures.CancelledError as exc:
            # Not ours (the loop cancels this task, not the future): Dask cancelled it, as
            # ``client.restart()`` cancels every task and restarts the workers; so does a client
            # losing its scheduler, and one giving up reconnecting.
            _check_client(client)
            raise WorkerLost(f"Dask cancelled the task: {exc}") from exc
        finally:
            if not done:
                with anyio.CancelScope(shield=True), anyio.move_on_after(5):
                    if claim is not None:
                        channel = _channel.listening(claim[0])
                        if channel is not None:
                            channel.drop(claim[1])
                    # A closed client cannot cancel ("Client is closed"): the error that ended
                    # the wait is the one to tell.
                    with contextlib.suppress(Exception):
                        if client.asynchronous:
                            await client.cancel([future])
                        else:
                            await anyio.to_thread.run_sync(future.cancel)
        return result

    def _look(self, client: Any) -> None:
        """What a wait for a task does now and then: ``SchedulerLost`` once the client closed;
        it keeps a cluster started here whole, and says when a cluster of yours has had no
        worker for ``_WORKERLESS_TOLD`` seconds (Dask waits for one to join, silently). Dask's
        ``LocalCluster`` closes a worker's nanny for good when the worker it restarts after a
        crash is not back within ``distributed.deploy.lost-worker-timeout`` (15 s): an agent
        crashing its worker again and again left the cluster with no worker, and the run
        waiting for ever."""
        _check_client(client)
        cluster, wanted = self._cluster, self._local_workers
        if cluster is not None and wanted is not None:
            if len(cluster.workers) < wanted:
                cluster.scale(wanted)  # (from any thread: it only asks the cluster's loop)
            return
        now = time.monotonic()
        if now - self._looked < _WATCH:  # (one look for all the episodes waiting)
            return
        self._looked = now
        if client.asynchronous:  # its cached view (two seconds old at most): no call
            info = client.scheduler_info()
            # (a count since distributed 2025.4; before, every worker's identity)
            workers = info.get("n_workers", len(info.get("workers", ())))
        else:
            try:
                workers = len(client.nthreads())
            except Exception:  # (a scheduler lost: the client closing tells it, SchedulerLost)
                return  # a look only: never the episode's failure
        if workers:
            self._workerless = None
        elif self._workerless is None:
            self._workerless = time.time()
        elif time.time() - self._workerless >= _WORKERLESS_TOLD:
            since = time.strftime("%H:%M:%S", time.localtime(self._workerless))
            self._workerless = math.inf  # told, until workers come back
            address = client.scheduler.address
            # Never the failure of the episode whose wait looked (warnings made errors).
            with contextlib.suppress(Warning):
                warnings.warn(
                    f"the Dask scheduler at {address} has had no worker since {since}: the "
                    f"run's episodes wait until one joins (start them with `dask worker "
                    f"{address} --nthreads 1`, or scale your cluster)",
                    UserWarning,
                    stacklevel=1,
                )

    async def aclose(self) -> None:
        """Close the client and cluster opened here (a client passed in is left open)."""
        client, self._client = self._client, None
        cluster, self._cluster = self._cluster, None
        if not self._owned:
            return
        with anyio.CancelScope(shield=True):
            for thing in (client, cluster):
                if thing is None:
                    continue
                if getattr(thing, "asynchronous", False):
                    await thing.close()
                else:
                    await anyio.to_thread.run_sync(thing.close)


async def _result(look: Callable[[], None], future: Any) -> Any:
    """``await future`` of an asynchronous client, calling ``look`` (``DaskExecutor._look``)
    every ``_WATCH`` seconds meanwhile.

    Not by cancelling the wait now and then: once the task ended, the wait is the client's
    gather, shared by the futures that ended with it, and cancelling it cancels theirs."""
    gathering = asyncio.ensure_future(future)
    try:
        while not (await asyncio.wait({gathering}, timeout=_WATCH))[0]:
            look()
    finally:
        if not gathering.done():
            gathering.cancel()  # this episode is cancelled
    if gathering.cancelled():  # the gather it shared was cancelled: another episode's
        return await _result(look, future)
    return gathering.result()


def _wait(look: Callable[[], None], future: Any) -> Any:
    """``future.result()`` of a synchronous client, in a thread, as ``_result``."""
    while True:
        try:
            return future.result(timeout=_WATCH)
        except TimeoutError:
            if future.done():  # it ended as the wait timed out, or raised TimeoutError itself
                return future.result()
            look()


def as_dask(executor: Any) -> DaskExecutor | None:
    """``executor`` as a ``DaskExecutor`` if it is one, a Dask client or an address; else None."""
    if isinstance(executor, DaskExecutor):
        return executor
    if isinstance(executor, str):
        return DaskExecutor(executor)
    cls = type(executor)
    if cls.__module__.split(".")[0] == "distributed" and cls.__name__ == "Client":
        return DaskExecutor(executor)
    return None


class DaskPool(WorkerPool):
    """The ``WorkerPool`` of a ``DaskExecutor``: one episode per task (each attempt is claimed)."""

    groups_episodes = False
    stops_calls = False  # Dask cannot interrupt a running task

    def __init__(self, dask: DaskExecutor, limiter: anyio.CapacityLimiter) -> None:
        super().__init__(limiter)
        from distributed import KilledWorker  # the task's workers kept dying

        self.dask = dask
        self.listen = dask.listen
        self.died = (KilledWorker, WorkerLost)

    async def warm_up(self, count: int, fn: Callable[..., int], *args: Any) -> None:
        await self.dask.connect()  # no scheduler, or workers of other versions: no runner
        await super().warm_up(count, fn, *args)

    async def submit(self, fn: Callable[..., T], *args: Any) -> T:
        async with self.limiter:
            return await self.dask.call(fn, *args)

    async def submit_episodes(self, jobs: Sequence[EpisodeJob]) -> None:
        (job,) = jobs  # groups_episodes is False
        async with self.limiter:
            await self.dask.play(job)

    async def stop(self) -> None:
        await self.dask.aclose()  # a client or cluster it opened (yours stays open)
