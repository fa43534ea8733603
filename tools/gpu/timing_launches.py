"""Launches of a phase-timing build on a 27B-shaped random model, for the per-block tools in this folder.

Each launch starts from the same prefilled state (`CONTEXT` tokens) with fresh random ids; the first two load the
module and warm the caches and are dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from onestream.kernels.benchmark import prefilled
from onestream.kernels.diagnostics import DiagnosticRunner
from onestream.kernels.random_model import config_27b, random_model
from onestream.kernels.tuning import Tuning
from onestream.worker.config import ModelConfig

CONTEXT = 64
WARMUP = 2


@dataclass
class TimedLaunches:
    config: ModelConfig
    runner: Any  # DiagnosticRunner
    stamps: list[np.ndarray]  # per launch: [steps, blocks, (start, end)] ns
    sms: list[np.ndarray]  # per launch: the SM of each block


def timed_launches(layers: int, gemv: str, tokens: int, launches: int) -> TimedLaunches:
    config = config_27b(layers)
    model = random_model(config, seed=7)
    runner = DiagnosticRunner(model, tuning=Tuning(mma=gemv == "mma", phase_timing=True))
    runner.prepare(tokens)
    state, _, _ = prefilled(model, CONTEXT, CONTEXT + tokens + 8, seed=11)
    stamps, sms = [], []
    for i in range(launches + WARMUP):
        ids = torch.randint(0, config.vocab_size, (tokens,), device="cuda")
        runner.step(ids, state.clone(), check=False)
        if i >= WARMUP:
            stamps.append(runner.phase_stamps().copy())
            sms.append(runner.block_sms().copy())
    return TimedLaunches(config, runner, stamps, sms)
