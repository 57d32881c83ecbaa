"""The worker → runner channel: Unix socket or TCP, claims, and what a worker sees when it is gone."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio
import anyio.lowlevel
import anyio.to_thread
import pytest

from asyncrunner._engine import _channel
from asyncrunner._engine._channel import ChannelClosed, claim, connect, open_channel

from .helpers import BOTH_LOOPS

pytestmark = [pytest.mark.anyio, BOTH_LOOPS]


@pytest.fixture(autouse=True)
def no_kept_connection(monkeypatch: pytest.MonkeyPatch) -> None:
    # The worker side keeps one connection per thread: start and end each test without any.
    monkeypatch.setattr(_channel, "_local", _channel._Local())


@pytest.mark.parametrize("listen", [None, "tcp://127.0.0.1:0"], ids=["unix", "tcp"])
async def test_events_and_claims_reach_the_runner(listen: str | None) -> None:
    async with open_channel(listen=listen) as channel:
        if listen is not None:
            assert channel.address.startswith("tcp://127.0.0.1:")

        def worker() -> tuple[Callable[[Any], None], bool, bool]:
            send = connect(channel.address, channel.token)
            send({"step": 1})
            first = claim(channel.address, channel.token, "0/1")
            return send, first, claim(channel.address, channel.token, "0/1")

        send, first, again = await anyio.to_thread.run_sync(worker)
        with anyio.fail_after(10):
            assert await channel.receive.receive() == {"step": 1}
        assert (first, again) == (True, False)  # an attempt is played once
        assert "0/1" in channel.claims
    # The run is over: the worker's next send tells it to stop.

    def late() -> None:
        for _ in range(100):  # the peer's close may take a few sends to show
            send({"step": 2})

    with pytest.raises(ChannelClosed, match="channel closed"):
        await anyio.to_thread.run_sync(late)


async def test_a_worker_that_cannot_reach_the_runner_is_told(tmp_path: anyio.Path) -> None:
    with pytest.raises(ChannelClosed, match="cannot reach the runner") as caught:
        await anyio.to_thread.run_sync(connect, str(tmp_path / "nothing"), "token")
    # A Dask worker with a private /tmp (systemd's PrivateTmp, a container): what to do.
    assert "listen='tcp://HOST:0'" in str(caught.value)


async def test_a_worker_that_cannot_reach_the_runner_on_tcp_is_told_what_to_do() -> None:
    # A Dask worker on another machine: the listen address is this machine's, and reachable?
    with pytest.raises(ChannelClosed, match="cannot reach the runner") as caught:
        await anyio.to_thread.run_sync(connect, "tcp://127.0.0.1:1", "token")
    assert "the workers must reach it" in str(caught.value)
    # ... and its episode says so, not that its worker process died (it did not).
    from asyncrunner._engine._dispatch import _died

    said = _died(str(caught.value), "ChannelClosed")(0)
    assert said.startswith("the worker process's connection to this runner failed (cannot reach")
    assert _died("exit code -9", "BrokenWorkerProcess")(3).startswith(
        "the worker process died (exit code -9); step 3 was the last received"
    )


async def test_listen_must_be_a_tcp_address() -> None:
    with pytest.raises(ValueError, match=r"tcp://HOST:PORT"):
        async with open_channel(listen="udp://127.0.0.1:0"):
            pass


@pytest.mark.parametrize("listen", [None, "tcp://127.0.0.1:0"], ids=["unix", "tcp"])
async def test_closing_while_a_frame_arrives(listen: str | None) -> None:
    # Data that becomes readable in the same loop turn as the run's cancellation: the read
    # being cancelled must not be completed as well (anyio's own UNIX socket streams, on
    # asyncio, raise InvalidStateError from a loop callback then: agronholm/anyio#1267).
    import pickle
    import socket

    from asyncrunner._engine._channel import _tcp, frame

    for _ in range(3):
        async with open_channel(listen=listen) as channel:
            tcp = _tcp(channel.address)
            sock = socket.socket(socket.AF_UNIX) if tcp is None else socket.socket()
            with sock:
                sock.connect(channel.address if tcp is None else tcp)
                sock.sendall(frame(channel.token.encode() + b" 1"))
                with anyio.fail_after(10):  # the runner read the hello...
                    while 1 not in channel.pids:  # noqa: ASYNC110 - no event for a read
                        await anyio.sleep(0.001)
                await anyio.wait_all_tasks_blocked()  # ...and now waits for the next frame
                sock.sendall(frame(pickle.dumps("event")))
                # The close below runs in the loop turn that sees the frame.
                await anyio.lowlevel.checkpoint()


async def test_a_cancelled_task_sees_its_cancellation_not_a_queue_closed_meanwhile() -> None:
    # A cancelled run: its sinks' tasks end (closing their queues) before the collector's next
    # send, which must end in the cancellation, as anyio's `send` does, not BrokenResourceError.
    send, receive = anyio.create_memory_object_stream[int](4)
    receive.close()
    with anyio.CancelScope() as scope:
        scope.cancel()
        await _channel.send_soon(send, 1)
    assert scope.cancelled_caught
    with pytest.raises(anyio.BrokenResourceError):
        await _channel.send_soon(send, 1)  # not cancelled: the closed queue is an error
    send.close()
    send, receive = anyio.create_memory_object_stream[int](4)
    send.close()
    with anyio.CancelScope() as scope:
        scope.cancel()
        await _channel.receive_soon(receive)
    assert scope.cancelled_caught
    with pytest.raises(anyio.EndOfStream):
        await _channel.receive_soon(receive)
    receive.close()
