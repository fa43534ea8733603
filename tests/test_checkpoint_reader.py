"""worker/checkpoints/reader.py: tensors read ahead, in order, within the window, with errors that name the file."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from onestream.worker.checkpoints import reader
from onestream.worker.errors import CheckpointError


@dataclass(frozen=True)
class Range:
    file: Path
    start: int
    end: int
    dtype: torch.dtype
    shape: tuple[int, ...]


def _files(tmp_path: Path, sizes: list[int]) -> tuple[list[Path], list[bytes]]:
    generator = torch.Generator().manual_seed(3)
    paths, blobs = [], []
    for i, size in enumerate(sizes):
        blob = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=generator).numpy().tobytes()
        path = tmp_path / f"f{i}.bin"
        path.write_bytes(blob)
        paths.append(path)
        blobs.append(blob)
    return paths, blobs


def test_tensors_come_back_in_order_with_their_bytes_across_files_and_pieces(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(reader, "PIECE_BYTES", 1000)  # many pieces per tensor, split mid-element
    paths, blobs = _files(tmp_path, [40_000, 25_000])
    ranges = [
        ("a", Range(paths[0], 8, 8 + 4 * 3000, torch.float32, (3000,))),
        ("b", Range(paths[0], 12_008, 12_008 + 2 * 50 * 70, torch.bfloat16, (50, 70))),
        ("empty", Range(paths[1], 0, 0, torch.float32, (0, 4))),
        ("c", Range(paths[1], 100, 100 + 24_000, torch.uint8, (24_000,))),
    ]
    got = list(reader.read_ahead(ranges, ahead_bytes=5000, threads=3))
    assert [k for k, _ in got] == ["a", "b", "empty", "c"]
    for (key, tensor), (_, r) in zip(got, ranges, strict=True):
        blob = blobs[paths.index(r.file)]
        assert tensor.dtype == r.dtype and tuple(tensor.shape) == r.shape, key
        assert tensor.contiguous().view(torch.uint8).numpy().tobytes() == blob[r.start : r.end], key


def test_reads_stay_within_the_window(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    paths, _ = _files(tmp_path, [64_000])
    ranges = [(i, Range(paths[0], i * 4000, (i + 1) * 4000, torch.uint8, (4000,))) for i in range(16)]
    yielded = 0
    most_ahead = 0
    allocate = reader._anonymous_bytes

    def counted(count: int) -> torch.Tensor:
        nonlocal most_ahead
        most_ahead = max(most_ahead, len(allocated) + 1 - yielded)
        allocated.append(count)
        return allocate(count)

    allocated: list[int] = []
    monkeypatch.setattr(reader, "_anonymous_bytes", counted)
    for _ in reader.read_ahead(ranges, ahead_bytes=12_000):
        yielded += 1
    assert len(allocated) == 16
    assert most_ahead == 3  # a 12,000-byte window holds three 4,000-byte tensors not yet handed out


def test_a_file_shorter_than_its_header_says_is_named(tmp_path: Path) -> None:
    paths, _ = _files(tmp_path, [1000])
    ranges = [("w", Range(paths[0], 500, 1500, torch.uint8, (1000,)))]
    with pytest.raises(CheckpointError, match=r"f0\.bin: truncated: the file ends at byte 1000"):
        list(reader.read_ahead(ranges))


def test_a_missing_file_is_named(tmp_path: Path) -> None:
    ranges = [("w", Range(tmp_path / "gone.bin", 0, 10, torch.uint8, (10,)))]
    with pytest.raises(CheckpointError, match=r"gone\.bin: cannot read"):
        list(reader.read_ahead(ranges))


def test_the_default_window_is_a_share_of_the_checkpoint_capped() -> None:
    assert reader.default_ahead_bytes(320 << 20) == 10 << 20
    assert reader.default_ahead_bytes(54 << 30) == reader.MAX_AHEAD_BYTES
