"""Load progress: bytes and tensors done, rate and time left, on a terminal, in log lines and to a callback."""

from __future__ import annotations

import io
import logging

import pytest
import torch
from onestream.worker.checkpoints import open_checkpoint
from onestream.worker.loading import load_model
from onestream.worker.progress import LoadProgress, ProgressReport, step_reporter
from onestream.worker.testing import write_tiny_checkpoint


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_load_reports_every_tensor_and_ends_at_one(tmp_path, caplog: pytest.LogCaptureFixture) -> None:
    checkpoint = open_checkpoint(write_tiny_checkpoint(tmp_path / "m"))
    sizes = checkpoint.stored_sizes()
    reports: list[ProgressReport] = []
    terminal = Terminal()
    progress = LoadProgress(sizes, stream=terminal, on_update=reports.append)
    with caplog.at_level(logging.INFO, logger="onestream.worker.progress"):
        load_model(checkpoint, dtype=torch.float32, progress=progress)
    assert len(reports) == len(sizes)
    assert [r.done_tensors for r in reports] == list(range(1, len(sizes) + 1))
    fractions = [r.fraction for r in reports]
    assert fractions == sorted(fractions) and fractions[-1] == 1.0
    assert reports[-1].done_bytes == sum(sizes.values()) == reports[-1].total_bytes
    assert reports[-1].eta_s == 0.0
    final = terminal.getvalue().rstrip("\n").rsplit("\r", 1)[-1]
    assert final.startswith("loading: 100.0%") and f"{len(sizes)}/{len(sizes)} tensors" in final
    assert "/s, 0s left" in final
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith(f"loading: {len(sizes)} tensors") for m in messages)
    assert any(m.startswith(f"loading done: {len(sizes)} tensors") for m in messages)


def test_no_terminal_means_no_drawing() -> None:
    stream = io.StringIO()
    progress = LoadProgress({"a": 10, "b": 30}, stream=stream)
    list(progress.track([("a", 1), ("b", 2)]))
    assert stream.getvalue() == ""
    assert progress.report().fraction == 1.0


def test_report_line_mid_load() -> None:
    report = ProgressReport("quantizing to q4_k_m", 2_000_000_000, 8_000_000_000, 100, 400, 10.0)
    assert report.fraction == 0.25
    assert (
        report.line() == "quantizing to q4_k_m:  25.0% 2.0 GB/8.0 GB, 100/400 tensors, 200.0 MB/s, 30s left"
    )


def test_steps_report_builds_done_rate_and_time_left(caplog: pytest.LogCaptureFixture) -> None:
    terminal = Terminal()
    reports: list[ProgressReport] = []
    on_step = step_reporter("compiling kernels", "builds", stream=terminal, on_update=reports.append)
    with caplog.at_level(logging.INFO, logger="onestream.worker.progress"):
        for done in range(1, 4):
            on_step(done, 3)
    assert [(r.done_tensors, r.total_tensors, r.items) for r in reports] == [
        (n, 3, "builds") for n in (1, 2, 3)
    ]
    assert [round(r.fraction, 3) for r in reports] == [0.333, 0.667, 1.0]
    final = terminal.getvalue().rstrip("\n").rsplit("\r", 1)[-1]
    assert final.startswith("compiling kernels: 100.0% 3/3 builds, ")
    assert final.endswith("builds/s, 0s left\x1b[K")
    messages = [r.getMessage() for r in caplog.records]
    assert "compiling kernels: 3 builds" in messages
    assert any(m.startswith("compiling kernels done: 3 builds in ") for m in messages)
    on_step(1, 2)  # a second sequence starts afresh
    assert (reports[-1].done_tensors, reports[-1].total_tensors) == (1, 2)


def test_report_line_of_steps() -> None:
    report = ProgressReport("compiling kernels", 2, 8, 2, 8, 10.0, items="builds", sized=False)
    assert report.line() == "compiling kernels:  25.0% 2/8 builds, 0.20 builds/s, 30s left"
