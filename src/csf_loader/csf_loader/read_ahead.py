"""A weight stream produced on a thread of its own, a bounded distance ahead of its consumer (no vLLM import).

Stock's loader takes one ``(name, tensor)`` at a time and copies it into its parameter; the CSF stream
does work of its own between those tensors (reading the compressed streams, checking them, staging and
launching the decode: 0.12-0.24 s of host time for the 768 planes measured on the H200 on 2026-12-04,
in line with stock's copies, so the CSF load came out 5-10 % slower than the source's). ``read_ahead``
runs the stream on a worker thread, so that work overlaps the consumer's copies; both spend their time
in torch and the file system, outside the interpreter lock.

It is opt-in (``CSF_LOADER_READ_AHEAD=1``): measured on an H100 (2026-12-05, both codecs, one run), the
stream in line loaded faster than the read-ahead (weights stage NVFP4 0.77 / 0.81 s, MXFP4 0.49 /
0.71 s, in line / ahead): on the thread the staging took 2-4x longer (0.10-0.22 s against 0.04-0.05 s),
the two threads contending for the host. It may pay where reading the files, not the host work, is
the bottleneck (a cold page cache on slow storage).

Guarantees: the consumer sees the stream's items in order; an exception the stream raises reaches
the consumer at the same place, after every item before it, unchanged (its message names file and
tensor); at most ``max_items`` items and ``max_bytes`` of tensor bytes wait, and one more in the
worker's hand (always at least one item waits, however large); closing the consumer's generator (a
failure in the weight loader, say) stops the worker and closes the stream before returning. CUDA
work of the stream runs on the consumer's device and current stream, so a decoded tensor is ordered
before the consumer's use of it.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Generator, Iterable, Iterator

import torch

ENV = "CSF_LOADER_READ_AHEAD"


class ReadAheadConfigError(ValueError):
    """``CSF_LOADER_READ_AHEAD`` is neither 0 nor 1."""


def read_ahead_enabled(value: str | None = None) -> bool:
    """``CSF_LOADER_READ_AHEAD``: 0 (default) keeps the CSF weight stream in line, 1 runs it ahead on a thread."""
    choice = (value if value is not None else os.environ.get(ENV, "0")).strip() or "0"
    if choice not in ("0", "1"):
        raise ReadAheadConfigError(
            f"{ENV}={choice!r}: use 0 (in line, one tensor at a time, the default) or 1 (decode the CSF stream on "
            "a thread ahead of stock's loader)"
        )
    return choice == "1"


def _tensor_bytes(item: tuple[str, torch.Tensor]) -> int:
    tensor = item[1]
    return tensor.numel() * tensor.element_size() if isinstance(tensor, torch.Tensor) else 0


class _Ahead:
    """The worker thread and the items it has produced but the consumer has not taken."""

    def __init__(self, stream: Iterable[tuple[str, torch.Tensor]], max_items: int, max_bytes: int) -> None:
        self.stream = stream
        self.max_items, self.max_bytes = max_items, max_bytes
        self.items: deque[tuple[str, torch.Tensor]] = deque()
        self.held = 0
        self.done = False
        self.error: BaseException | None = None
        self.stopping = False
        self.changed = threading.Condition()
        self.cuda: tuple[torch.device, torch.cuda.Stream] | None = None

    def work(self) -> None:
        iterator: Iterator[tuple[str, torch.Tensor]] | None = None
        try:  # everything the worker does, so that whatever fails reaches the consumer instead of hanging it
            if self.cuda is not None:
                device, stream = self.cuda
                torch.cuda.set_device(device)
                torch.cuda.set_stream(stream)
            iterator = iter(self.stream)
            for item in iterator:
                size = _tensor_bytes(item)
                with self.changed:
                    while (
                        self.items
                        and not self.stopping
                        and (len(self.items) >= self.max_items or self.held + size > self.max_bytes)
                    ):
                        self.changed.wait()
                    if self.stopping:
                        break
                    self.items.append(item)
                    self.held += size
                    self.changed.notify_all()
        except BaseException as exc:  # handed to the consumer, which raises it where it happened
            with self.changed:
                self.error = exc
        finally:
            close = getattr(iterator, "close", None) if iterator is not None else None
            if close is not None:
                try:
                    close()  # a generator's finally blocks (files, windows) run on the thread that ran it
                except BaseException as exc:
                    with self.changed:
                        self.error = self.error or exc
            with self.changed:
                self.done = True
                self.changed.notify_all()

    def take(self) -> tuple[str, torch.Tensor] | None:
        """The next item, or None at the end; raises the stream's error after the items before it."""
        with self.changed:
            while not self.items and not self.done:
                self.changed.wait()
            if self.items:
                item = self.items.popleft()
                self.held -= _tensor_bytes(item)
                self.changed.notify_all()
                return item
            if self.error is not None:
                raise self.error
            return None

    def stop(self) -> None:
        with self.changed:
            self.stopping = True
            self.items.clear()
            self.held = 0
            self.changed.notify_all()


def read_ahead(
    stream: Iterable[tuple[str, torch.Tensor]],
    device: torch.device | None = None,
    max_items: int = 64,
    max_bytes: int = 256 << 20,
) -> Generator[tuple[str, torch.Tensor], None, None]:
    """``stream``'s items, produced on a worker thread up to ``max_items`` / ``max_bytes`` ahead.

    With a CUDA ``device`` the worker uses that device and the current stream of the thread that
    starts iterating (the weight loader's)."""
    if max_items < 1 or max_bytes < 0:
        raise ValueError(f"read_ahead: max_items {max_items} must be >= 1 and max_bytes {max_bytes} >= 0")
    ahead = _Ahead(stream, max_items, max_bytes)
    if device is not None and torch.device(device).type == "cuda":
        device = torch.device(device)
        # the stream knows its device's index; `device` may be a bare torch.device("cuda"), which
        # torch.cuda.set_device refuses on the worker thread (2026-12-05, device_path_check on the H100)
        loader_stream = torch.cuda.current_stream(device)
        ahead.cuda = (loader_stream.device, loader_stream)
    worker = threading.Thread(target=ahead.work, name="csf-read-ahead", daemon=True)
    worker.start()
    try:
        while (item := ahead.take()) is not None:
            yield item
    finally:
        ahead.stop()
        worker.join()
