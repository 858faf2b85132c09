"""A trio client on a thread of its own, so blocking and asyncio code can use it: calls cross as futures.

The back-end clients (producer.py, consumer.py) are trio code; from asyncio
they fail (trio needs its own event loop) and from blocking code there is no
loop at all. Rather than write them three times, the blocking face
(store/clients/blocking.py) and the asyncio face (store/clients/aio.py) run
the very trio client, unchanged, in a dedicated thread that runs ``trio.run``
for the client's lifetime, and hand each call to it:

- :meth:`TrioThread.submit` starts the call as a task on the trio thread and
  returns a ``concurrent.futures.Future``: the blocking face waits on
  ``.result()``, the asyncio face awaits ``asyncio.wrap_future(...)``, so a
  waiting asyncio coroutine holds no executor thread and blocks no loop.
  Cancelling the future (an asyncio task cancelled) cancels the trio task.
- :meth:`TrioThread.call` runs a quick synchronous method (``Producer.send``)
  on the trio thread and returns its result or raises its error at once.

Why not anyio: the clients sit on the store RPC client (store/rpc), written
against trio's primitives (nurseries, memory channels, ``trio.Event``);
porting it to anyio would change the store's own code for no gain to trio
users. One thread per client costs little next to its socket, and the
semantics are the trio client's by construction.

Resource handling: the thread enters the client's async context manager
(``Producer.connect(...)``) and stays inside it until :meth:`close`, which
leaves it (flushing, leaving the group) and joins the thread. ``close(error)``
leaves it as a block that raised (no flush), like the trio face.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any, ClassVar, Generic, TypeVar, final

import trio

__all__ = ["ClientClosed", "Face", "TrioThread"]

T = TypeVar("T")
R = TypeVar("R")


class ClientClosed(RuntimeError):
    """The client was closed (or its trio thread ended): no more calls."""


class _LeaveAsFailed(Exception):
    """Raised inside the client's context manager so it leaves as a block that raised."""


@final
class TrioThread(Generic[T]):
    """One trio client (what ``open_client()`` enters) living on a trio thread.

    ``opened`` completes with the client once its context manager is entered (or with why it failed: the
    connection's error); ``closed`` once the thread ended (with the exit's error, if any).
    """

    def __init__(self, open_client: Callable[[], AbstractAsyncContextManager[T]], name: str) -> None:
        self._open_client = open_client
        self.opened: concurrent.futures.Future[T] = concurrent.futures.Future()
        self.closed: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._token: trio.lowlevel.TrioToken | None = None
        self._nursery: trio.Nursery | None = None
        self._stop: trio.Event | None = None
        self._failed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            trio.run(self._main)
        except BaseException as exc:  # the client's error goes to whoever waits on the futures, on their thread
            if not self.opened.done():
                self.opened.set_exception(exc)
            self.closed.set_exception(exc)
            return
        self.closed.set_result(None)

    async def _main(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._stop = trio.Event()
        try:
            async with self._open_client() as client, trio.open_nursery() as nursery:
                self._nursery = nursery
                self.opened.set_result(client)
                await self._stop.wait()
                nursery.cancel_scope.cancel()  # calls still running end (their futures are cancelled)
                if self._failed:
                    raise _LeaveAsFailed
        except _LeaveAsFailed:
            pass
        finally:
            self._nursery = None

    def submit(self, function: Callable[..., Awaitable[R]], *args: Any) -> concurrent.futures.Future[R]:
        """Run ``await function(*args)`` as a task on the trio thread; its outcome completes the future.

        Raises:
            ClientClosed: the client is closed.
        """
        future: concurrent.futures.Future[R] = concurrent.futures.Future()
        self._soon(self._start_task, future, function, args)
        return future

    def call(self, function: Callable[..., R], *args: Any, **kwargs: Any) -> R:
        """``function(*args, **kwargs)`` run on the trio thread (a quick, synchronous call); its result or error.

        Raises:
            ClientClosed: the client is closed.
        """
        if self._nursery is None or self._token is None:
            raise ClientClosed("the client is closed")
        try:
            return trio.from_thread.run_sync(lambda: function(*args, **kwargs), trio_token=self._token)
        except trio.RunFinishedError:
            raise ClientClosed("the client is closed") from None

    def close(self, error: BaseException | None = None) -> concurrent.futures.Future[None]:
        """Leave the client (as a block that raised ``error``, when given) and end the thread; ``closed`` is
        returned, to wait on."""
        if self._stop is not None and not self.closed.done():
            self._failed = error is not None
            self._soon_if_running(self._stop.set)
        return self.closed

    def _soon(self, function: Callable[..., object], *args: Any) -> None:
        if self._nursery is None or self._token is None:
            raise ClientClosed("the client is closed")
        try:
            self._token.run_sync_soon(function, *args)
        except trio.RunFinishedError:
            raise ClientClosed("the client is closed") from None

    def _start_task(self, future: concurrent.futures.Future[R], function: Callable[..., Awaitable[R]],
                    args: tuple[Any, ...]) -> None:
        if self._nursery is None:  # closed between the submit and now
            future.set_exception(ClientClosed("the client is closed"))
            return
        self._nursery.start_soon(self._task, future, function, args)

    async def _task(self, future: concurrent.futures.Future[R], function: Callable[..., Awaitable[R]],
                    args: tuple[Any, ...]) -> None:
        if future.cancelled():  # by its waiter, before the task started
            return
        with trio.CancelScope() as scope:
            future.add_done_callback(lambda f: f.cancelled() and self._soon_if_running(scope.cancel))
            try:
                result = await function(*args)
            except trio.Cancelled:
                future.cancel()
                raise
            except Exception as exc:  # the caller's to see, on its own thread
                _complete(future, exc)
                return
            _complete(future, result)
        if scope.cancelled_caught:
            future.cancel()

    def _soon_if_running(self, function: Callable[[], object]) -> None:
        """``function`` run on the trio thread, unless the thread has ended (then there is nothing to do)."""
        try:
            self._token.run_sync_soon(function)  # type: ignore[union-attr]
        except trio.RunFinishedError:
            pass


def _complete(future: concurrent.futures.Future[Any], outcome: Any) -> None:
    """Set the future's outcome unless it was cancelled meanwhile."""
    if future.done():
        return
    try:
        if isinstance(outcome, BaseException):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)
    except concurrent.futures.InvalidStateError:  # cancelled by its waiter on another thread just now
        pass


class Face(Generic[T]):
    """What the blocking and asyncio faces of a trio client hold: its trio thread and the client on it.

    A face names the trio client's ``connect`` as ``trio_client``; :meth:`start` opens it on a new thread.
    """

    trio_client: ClassVar[Callable[..., AbstractAsyncContextManager[Any]]]

    def __init__(self, thread: TrioThread[T], client: T) -> None:
        self._thread = thread
        self._client = client

    @classmethod
    def start(cls, host: str, port: int | None, options: dict[str, Any]) -> TrioThread[T]:
        """A trio thread connecting ``trio_client(host, port, **options)``; wait on its ``opened``."""
        return TrioThread(lambda: cls.trio_client(host, port, **options), f"lightgate-{cls.__name__}")
