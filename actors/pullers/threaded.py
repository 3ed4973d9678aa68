"""Blocking reading and parsing run in a thread of their own, handed to the event loop a few
items ahead.

A replay of files (the CSV input, the JSON Lines input not following) reads and parses chunks of
thousands of reports at a time: milliseconds of work between two turns of the event loop. On
the loop, a live input of the same process (a socket, the meter's port) waits that long for each
of its turns. Here a blocking iterator runs in a dedicated thread instead, and its items come to
the loop through a bounded hand-off: the thread stays at most ``ahead`` items in front of what
the loop took, then waits (back-pressure, nothing dropped), so a replay still reads no faster
than the pipeline takes it.

One item crosses per hand-off, so an item should be a chunk's worth (a frame, a list of
reports), never a report: :func:`batched` groups an iterator of reports into lists.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Generator, Iterator
from itertools import islice
from types import TracebackType
from typing import Generic, TypeVar

T = TypeVar("T")

AHEAD = 2
"""Items the thread makes before the loop took them: one being handed on, one ready behind it."""


class _Last:
    """What the thread hands over last: the iterator's end, or the error it raised."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException | None = None) -> None:
        self.error = error


class InThread(Generic[T]):
    """The items of ``make()``, an iterator made, run and closed in a thread of its own.

    Use it as ``async with InThread(lambda: read(paths)) as items: async for item in items``.
    The iterator is made in the thread too, so whatever it opens is opened there. An exception
    it raises is raised by the ``async for`` (with its traceback, the thread's frames included),
    after the items before it. Leaving the ``async with`` early (a stop, a cancellation, an
    error) tells the thread to stop; the thread closes the iterator where it ran it (a
    generator's ``finally`` blocks close its files) and ends, and the exit waits for that: no
    thread outlives the block. A thread in the middle of a step finishes that step first.
    """

    def __init__(
        self, make: Callable[[], Iterator[T]], *, ahead: int = AHEAD, name: str = "replay"
    ) -> None:
        if ahead < 1:
            raise ValueError(f"ahead must be at least 1, not {ahead}")
        self._make = make
        self._name = name
        self._room = threading.Semaphore(ahead)
        """One permit per item the thread may make before the loop takes one."""
        self._stop = threading.Event()
        self._ready: asyncio.Queue[T | _Last] = asyncio.Queue()
        self._finished: asyncio.Future[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._done = False
        self.thread: threading.Thread | None = None
        """The thread, once started (for the tests: it is no longer alive after the block)."""

    async def __aenter__(self) -> InThread[T]:
        self._loop = asyncio.get_running_loop()
        self._finished = self._loop.create_future()
        self.thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        self.thread.start()
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.aclose()

    def __aiter__(self) -> InThread[T]:
        return self

    async def __anext__(self) -> T:
        if self._done:
            raise StopAsyncIteration
        item = await self._ready.get()
        if isinstance(item, _Last):
            self._done = True
            if item.error is None:
                raise StopAsyncIteration
            raise item.error
        self._room.release()
        return item

    async def aclose(self) -> None:
        """Stop the thread, wait until it closed the iterator and ended."""
        self._done = True
        self._stop.set()
        self._room.release()  # a thread waiting for room wakes, sees the stop and ends
        if self._finished is not None:
            await asyncio.shield(self._finished)
        if self.thread is not None:
            self.thread.join()  # it has only to return now

    # --- in the thread -----------------------------------------------------------------------

    def _run(self) -> None:
        items: Iterator[T] | None = None
        try:
            items = self._make()
            while self._room.acquire() and not self._stop.is_set():
                try:
                    item = next(items)
                except StopIteration:
                    self._hand(_Last())
                    return
                self._hand(item)
        except BaseException as error:  # the loop raises it
            self._hand(_Last(error))
        finally:
            try:
                close = getattr(items, "close", None)
                if close is not None:
                    close()
            except BaseException as error:  # the loop raises it
                self._hand(_Last(error))
            self._call(self._set_finished)

    def _hand(self, item: T | _Last) -> None:
        self._call(self._ready.put_nowait, item)

    def _call(self, callback: Callable[..., object], *args: object) -> None:
        """Run ``callback`` on the loop; a loop already closed (the block was never left, as
        at an interpreter's exit) stops the thread instead."""
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:
            self._stop.set()

    def _set_finished(self) -> None:
        if self._finished is not None and not self._finished.done():
            self._finished.set_result(None)


def batched(items: Iterator[T], size: int) -> Generator[list[T], None, None]:
    """``items`` in lists of ``size`` (the last one shorter): what crosses from a thread
    (:class:`InThread`) is a list of reports, never one report at a time. Closed early, it
    closes ``items`` (a generator's files then close in the thread that read them)."""
    try:
        while chunk := list(islice(items, size)):
            yield chunk
    finally:
        close = getattr(items, "close", None)
        if close is not None:
            close()
