"""Streams and events: the ordering the worker's copies follow, on a GPU and on the CPU.

The worker moves blocks on *copy streams* beside the engine's *compute stream*, and
orders the two with events, as CUDA does::

    Stream.run(work)     enqueue ``work`` (torch calls) on the stream; returns at once
    Stream.record()      an Event that completes when the work enqueued so far has
    Stream.wait(event)   work enqueued on the stream from now on starts after ``event``
    Event.query()        completed?          Event.synchronize()   block until it has

Three implementations of the one protocol:

``CudaStream``    a ``torch.cuda.Stream`` (or the current stream: the engine's compute
                  stream), events are ``torch.cuda.Event``: work is kernels and DMA
                  copies launched inside ``torch.cuda.stream(...)``.
``InlineStream``  the CPU backend: work runs at once in the caller, every event is
                  complete, ``wait`` blocks the caller until the event completes.
``ThreadStream``  a CPU stream with its own thread: work runs later, in order, so
                  copies really are asynchronous; ``gate`` holds it (a test controls
                  when each piece of work may run). The tests and the GPU benchmark's
                  ``--device cpu`` run the asynchronous path with it.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

logger = logging.getLogger(__name__)

Work = Callable[[], None]


class Event(Protocol):
    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


class Stream(Protocol):
    def run(self, work: Work) -> None: ...

    def record(self) -> Event: ...

    def wait(self, event: Event) -> None: ...


@dataclass(frozen=True)
class CopyStreams:
    """The compute stream the engine's forward runs on, and the worker's two copy streams
    (loads host -> device, saves device -> host: two, so both directions move at once)."""

    compute: Stream
    loads: Stream
    saves: Stream

    @classmethod
    def inline(cls) -> CopyStreams:
        """The CPU backend's: every copy runs at once on the caller's thread."""
        stream = InlineStream()
        return cls(stream, stream, stream)

    @classmethod
    def cuda(cls, device: Any) -> CopyStreams:
        """Two new CUDA streams on ``device`` beside its current stream."""
        import torch

        return cls(
            CudaStream(None),
            CudaStream(torch.cuda.Stream(device=device)),
            CudaStream(torch.cuda.Stream(device=device)),
        )

    @classmethod
    def threads(cls, gate: Callable[[], None] | None = None) -> CopyStreams:
        """Copies on two threads (loads, saves), the compute stream inline; ``gate`` is
        called before each piece of copy work."""
        return cls(InlineStream(), ThreadStream("loads", gate), ThreadStream("saves", gate))

    def close(self) -> None:
        for stream in (self.loads, self.saves):
            if isinstance(stream, ThreadStream):
                stream.close()


class CudaStream:
    """A CUDA stream; ``None``: whichever stream is current when called (the engine's)."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def _current(self) -> Any:
        import torch

        return self._stream if self._stream is not None else torch.cuda.current_stream()

    def run(self, work: Work) -> None:
        if self._stream is None:
            work()
            return
        import torch

        with torch.cuda.stream(self._stream):
            work()

    def record(self) -> Event:
        import torch

        event = torch.cuda.Event()
        event.record(self._current())
        return event  # type: ignore[no-any-return]

    def wait(self, event: Event) -> None:
        self._current().wait_event(event)


class DoneEvent:
    """An event that has completed."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


class InlineStream:
    def run(self, work: Work) -> None:
        work()

    def record(self) -> Event:
        return DoneEvent()

    def wait(self, event: Event) -> None:
        event.synchronize()


class StreamError(RuntimeError):
    """Work on a ``ThreadStream`` raised; every event recorded after it raises this."""


class ThreadEvent:
    def __init__(self) -> None:
        self._done = threading.Event()
        self.error: BaseException | None = None

    def set(self, error: BaseException | None) -> None:
        self.error = error
        self._done.set()

    def query(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout_s: float) -> bool:
        """Whether it completed within ``timeout_s`` (tests: that work is still held)."""
        return self._done.wait(timeout_s)

    def synchronize(self) -> None:
        self._done.wait()
        if self.error is not None:
            raise StreamError("work on a copy stream failed") from self.error


class ThreadStream:
    """Work runs on the stream's own daemon thread, in the order it was enqueued."""

    def __init__(self, name: str, gate: Callable[[], None] | None = None) -> None:
        self._gate = gate
        self._items: queue.Queue[tuple[str, Any] | None] = queue.Queue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name=f"kvtier-{name}", daemon=True)
        self._thread.start()

    def run(self, work: Work) -> None:
        self._items.put(("run", work))

    def record(self) -> Event:
        event = ThreadEvent()
        self._items.put(("record", event))
        return event

    def wait(self, event: Event) -> None:
        self._items.put(("wait", event))

    def close(self) -> None:
        self._items.put(None)
        self._thread.join(5.0)

    def _loop(self) -> None:
        while (item := self._items.get()) is not None:
            kind, value = item
            if kind == "record":
                value.set(self._error)
            elif kind == "wait":
                try:
                    value.synchronize()
                except StreamError as exc:
                    self._error = self._error or exc
            elif self._error is None:  # like CUDA: after an error nothing more runs
                try:
                    if self._gate is not None:
                        self._gate()
                    value()
                except BaseException as exc:
                    logger.exception("kvtier: copy work failed on a CPU stream")
                    self._error = exc
            del item, kind, value  # hold nothing of done work while waiting for more
