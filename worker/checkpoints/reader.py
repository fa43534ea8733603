"""Reading a checkpoint's tensors from disk ahead of their use.

Copying tensors out of a memory-mapped file reads a cold disk one page fault at a time, a fraction of what the
disk gives to deep queues of large reads, and the loader's work on a tensor (casting it, copying it to the
device, quantizing it) waits for the next tensor's pages. `read_ahead` reads the coming tensors in pieces on a
few threads while the caller works on the current one, never more than `ahead_bytes` beyond it, so peak host
memory grows by at most that window.
"""

from __future__ import annotations

import mmap
import os
from collections import deque
from collections.abc import Hashable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Protocol

import torch

from ..errors import CheckpointError

PIECE_BYTES = (
    16 << 20
)  # one read call: large enough for deep device queues, small enough to spread over threads
READ_THREADS = 4
MAX_AHEAD_BYTES = 1 << 30
AHEAD_SHARE = 32  # the window is at most 1/32 of the checkpoint, so small models stay near their own size


class FileRange(Protocol):
    """A tensor's bytes in a file: [start, end) read as `dtype` of `shape` (hf.StoredTensor is one)."""

    @property
    def file(self) -> Path: ...
    @property
    def start(self) -> int: ...
    @property
    def end(self) -> int: ...
    @property
    def dtype(self) -> torch.dtype: ...
    @property
    def shape(self) -> tuple[int, ...]: ...


def default_ahead_bytes(total_bytes: int) -> int:
    return min(MAX_AHEAD_BYTES, total_bytes // AHEAD_SHARE)


def read_ahead(
    ranges: Sequence[tuple[Hashable, FileRange]],
    *,
    ahead_bytes: int | None = None,
    threads: int = READ_THREADS,
) -> Iterator[tuple[Hashable, torch.Tensor]]:
    """Yield (key, tensor) for every range in order, each tensor a fresh CPU tensor owned by the caller.

    Reads beyond the tensor being yielded stay within `ahead_bytes` (default: `default_ahead_bytes` of the
    total); a range larger than the window is still read whole, alone."""
    window = (
        ahead_bytes
        if ahead_bytes is not None
        else default_ahead_bytes(sum(r.end - r.start for _, r in ranges))
    )
    descriptors: dict[Path, int] = {}
    pending: deque[tuple[Hashable, FileRange, torch.Tensor, list[Future[None]]]] = deque()
    pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="checkpoint-read")
    queued_bytes = 0
    following = iter(ranges)
    upcoming: tuple[Hashable, FileRange] | None = next(following, None)
    try:
        while pending or upcoming is not None:
            while upcoming is not None and (not pending or queued_bytes + _size(upcoming[1]) <= window):
                key, stored = upcoming
                target = _anonymous_bytes(_size(stored))
                fd = descriptors.get(stored.file)
                if fd is None:
                    fd = descriptors[stored.file] = _open(stored.file)
                pending.append((key, stored, target, _submit_pieces(pool, fd, stored, target)))
                queued_bytes += _size(stored)
                upcoming = next(following, None)
            key, stored, target, pieces = pending.popleft()
            for piece in pieces:
                piece.result()
            queued_bytes -= _size(stored)
            tensor = _typed(target, stored)
            del target, pieces
            yield key, tensor
            del tensor  # the caller's copy may be gone by now; ours must not outlive it
    finally:
        for _, _, _, pieces in pending:
            for piece in pieces:
                piece.cancel()
        pool.shutdown(wait=True)
        for fd in descriptors.values():
            os.close(fd)


def _anonymous_bytes(count: int) -> torch.Tensor:
    """`count` bytes of their own mapping, returned to the system when the tensor dies: from the heap,
    freed buffers of these sizes stay resident (glibc raises its mmap threshold after the first frees)."""
    if count == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(mmap.mmap(-1, count), dtype=torch.uint8)


def _open(path: Path) -> int:
    try:
        return os.open(path, os.O_RDONLY)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e})") from e


def _submit_pieces(
    pool: ThreadPoolExecutor, fd: int, stored: FileRange, target: torch.Tensor
) -> list[Future[None]]:
    view = memoryview(target.numpy())
    return [
        pool.submit(_read_piece, fd, stored, view[at : at + PIECE_BYTES], stored.start + at)
        for at in range(0, _size(stored), PIECE_BYTES)
    ]


def _read_piece(fd: int, stored: FileRange, into: memoryview, offset: int) -> None:
    done = 0
    while done < len(into):
        try:
            count = os.preadv(fd, [into[done:]], offset + done)
        except OSError as e:
            raise CheckpointError(f"{stored.file}: read failed at byte {offset + done} ({e})") from e
        if count == 0:
            raise CheckpointError(
                f"{stored.file}: truncated: the file ends at byte {offset + done}, a tensor needs bytes up to {stored.end}"
            )
        done += count


def _size(stored: FileRange) -> int:
    return stored.end - stored.start


def _typed(raw: torch.Tensor, stored: FileRange) -> torch.Tensor:
    if _size(stored) == 0:
        return torch.empty(stored.shape, dtype=stored.dtype)
    return raw.view(stored.dtype).view(stored.shape)
