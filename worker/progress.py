"""Progress of a long model load: bytes and tensors done, rate, time left.

Reported three ways: a line rewritten in place on a terminal (when stderr is one), log lines every few
seconds, and a callback with the fraction done (the card's `loading` state in `onestream status`). Weight
loads count bytes and tensors; kernel compilation (`step_reporter`) counts builds.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import IO, TypeVar

log = logging.getLogger(__name__)

LOG_EVERY_S = 5.0
DRAW_EVERY_S = 0.2
T = TypeVar("T")


@dataclass(frozen=True)
class ProgressReport:
    stage: str  # "loading", "quantizing", ...
    done_bytes: int
    total_bytes: int
    done_tensors: int
    total_tensors: int
    elapsed_s: float
    items: str = "tensors"  # what is counted: "tensors", or "builds" for kernel compilation
    sized: bool = True  # the bytes are meaningful (a weight load); else only the items count

    @property
    def fraction(self) -> float:
        return self.done_bytes / self.total_bytes if self.total_bytes else 1.0

    @property
    def rate(self) -> float:
        """Bytes per second so far."""
        return self.done_bytes / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def eta_s(self) -> float | None:
        return (self.total_bytes - self.done_bytes) / self.rate if self.rate > 0 else None

    def line(self) -> str:
        eta = "?" if self.eta_s is None else f"{self.eta_s:.0f}s"
        if not self.sized:
            per_s = self.done_tensors / self.elapsed_s if self.elapsed_s > 0 else 0.0
            return (
                f"{self.stage}: {self.fraction * 100:5.1f}% {self.done_tensors}/{self.total_tensors} "
                f"{self.items}, {per_s:.2f} {self.items}/s, {eta} left"
            )
        return (
            f"{self.stage}: {self.fraction * 100:5.1f}% {_size(self.done_bytes)}/{_size(self.total_bytes)}, "
            f"{self.done_tensors}/{self.total_tensors} tensors, {_size(self.rate)}/s, {eta} left"
        )


class LoadProgress:
    """Counts what a load has done; `track(items)` wraps the (name, value) iterator a checkpoint yields,
    counting each tensor's stored bytes (`sizes[name]`) once the consumer asks for the next one."""

    def __init__(
        self,
        sizes: Mapping[str, int],
        *,
        stage: str = "loading",
        stream: IO[str] | None = None,
        on_update: Callable[[ProgressReport], None] | None = None,
        items: str = "tensors",
        sized: bool = True,
    ) -> None:
        self.sizes = dict(sizes)
        self.stage = stage
        self.items = items
        self.sized = sized
        self.total_bytes = sum(self.sizes.values())
        self._stream = stream if stream is not None else sys.stderr
        self._draw = bool(getattr(self._stream, "isatty", lambda: False)())
        self._on_update = on_update
        self._done_bytes = 0
        self._done_tensors = 0
        self._start = time.monotonic()
        self._last_log = self._last_draw = self._start

    def report(self) -> ProgressReport:
        return ProgressReport(
            self.stage,
            self._done_bytes,
            self.total_bytes,
            self._done_tensors,
            len(self.sizes),
            time.monotonic() - self._start,
            self.items,
            self.sized,
        )

    def start(self) -> None:
        self._start = self._last_log = self._last_draw = time.monotonic()
        if self.sized:
            log.info("%s: %d %s, %s", self.stage, len(self.sizes), self.items, _size(self.total_bytes))
        else:
            log.info("%s: %d %s", self.stage, len(self.sizes), self.items)

    def track(self, items: Iterable[tuple[str, T]]) -> Iterator[tuple[str, T]]:
        self.start()
        for name, value in items:
            yield name, value
            self.advance(self.sizes.get(name, 0))
        self.finish()

    def advance(self, nbytes: int, tensors: int = 1) -> None:
        self._done_bytes += nbytes
        self._done_tensors += tensors
        now = time.monotonic()
        report = self.report()
        if self._on_update is not None:
            self._on_update(report)
        if self._draw and now - self._last_draw >= DRAW_EVERY_S:
            self._stream.write("\r" + report.line() + "\x1b[K")
            self._stream.flush()
            self._last_draw = now
        if now - self._last_log >= LOG_EVERY_S:
            log.info("%s", report.line())
            self._last_log = now

    def finish(self) -> None:
        report = self.report()
        if self._draw:
            self._stream.write("\r" + report.line() + "\x1b[K\n")
            self._stream.flush()
        if not self.sized:
            log.info("%s done: %d %s in %.1fs", self.stage, report.done_tensors, self.items, report.elapsed_s)
            return
        log.info(
            "%s done: %d tensors, %s in %.1fs (%s/s)",
            self.stage,
            report.done_tensors,
            _size(report.done_bytes),
            report.elapsed_s,
            _size(report.rate),
        )


def step_reporter(
    stage: str,
    items: str,
    *,
    stream: IO[str] | None = None,
    on_update: Callable[[ProgressReport], None] | None = None,
) -> Callable[[int, int], None]:
    """A callback `on_step(done, total)` for a sequence of steps of about equal cost whose count its runner
    knows (the megakernel's builds): each call reports as a load does, on the terminal, in log lines and to
    `on_update`; the call with done == total ends it. Lets kernels/ report without knowing this module."""
    current: list[LoadProgress] = []

    def on_step(done: int, total: int) -> None:
        if not current:
            current.append(
                LoadProgress(
                    dict.fromkeys(range(total), 1),
                    stage=stage,
                    stream=stream,
                    on_update=on_update,
                    items=items,
                    sized=False,
                )
            )
            current[0].start()
        progress = current[0]
        progress.advance(done - progress.report().done_tensors, done - progress.report().done_tensors)
        if done >= total:
            progress.finish()
            current.clear()

    return on_step


def _size(nbytes: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(nbytes) < 1000 or unit == "GB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1000
    return f"{nbytes:.1f} GB"
