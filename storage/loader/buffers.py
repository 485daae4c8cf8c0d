"""Double buffering: hand the consumer batch i while batch i + 1 is already built (and on CUDA, copied).

On CPU the producer thread fills a two-slot queue. On CUDA the producer pins each batch; the consumer
side issues the host→device copy of the next batch on a side stream as soon as it hands out the current
one, and the training stream waits on an event before it touches a batch.
"""
from __future__ import annotations

import queue
import threading

import torch


class Failure:
    """An exception raised in the producer thread, delivered to the consumer in order."""

    def __init__(self, exc: BaseException):
        self.exc = exc


class TwoSlotQueue:
    def __init__(self, slots: int = 2):
        self._q: queue.Queue = queue.Queue(maxsize=slots)

    def put(self, item, stop: threading.Event) -> bool:
        """Blocks while both slots are full; returns False if `stop` is set meanwhile."""
        while not stop.is_set():
            try:
                self._q.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def get(self, stop: threading.Event | None = None, alive=lambda: True):
        while True:
            try:
                return self._q.get(timeout=0.05)
            except queue.Empty:
                if (stop is not None and stop.is_set()) or not alive():
                    raise RuntimeError("loader producer stopped") from None

    def qsize(self) -> int:
        return self._q.qsize()

    def drain(self) -> None:
        while True:
            try:
                self._q.get_nowait()
            except queue.Empty:
                return


class CudaStager:
    """Keeps one batch in flight to the device on a side stream."""

    def __init__(self, device: str):
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(device=self.device)
        self._next: tuple[torch.Tensor, torch.cuda.Event] | None = None

    @staticmethod
    def pin(batch: torch.Tensor) -> torch.Tensor:
        return batch.pin_memory()

    def stage(self, host: torch.Tensor) -> None:
        with torch.cuda.stream(self.stream):
            dev = host.to(self.device, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self.stream)
        self._next = (dev, ev)

    def take(self) -> torch.Tensor | None:
        """The staged batch, safe to use on the current stream; None when nothing is staged."""
        if self._next is None:
            return None
        dev, ev = self._next
        self._next = None
        torch.cuda.current_stream(self.device).wait_event(ev)
        dev.record_stream(torch.cuda.current_stream(self.device))
        return dev

