"""The megakernel's test hooks and diagnostics, apart from the production launch paths of kernels/runtime.py.

`DiagnosticRunner` is a `MegakernelRunner` that can also launch one phase alone (`run_phase`, the per-phase
tests against the reference), run the grid barrier alone (`barrier_test`), describe its builds, and, built with
`Tuning(phase_timing=True)`, read back the per-block stamps of the last launch (kernels/phase_timing.py turns
them into the per-phase breakdown). Its launches are the runner's own.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .layout import MODE_MAIN, TIMING_FIELDS
from .runtime import MegakernelError, MegakernelRunner, _ptr


class DiagnosticRunner(MegakernelRunner):
    def __init__(self, model: Any, **kwargs: Any) -> None:
        super().__init__(model, **kwargs)
        if self.plan.tuning.phase_timing:
            # Per (step of a main-model launch, block) stamps, ns (layout.TIMING_FIELDS), and one more row: the
            # SM each block ran on.
            steps = len(self.plan.steps(MODE_MAIN))
            self._timing = torch.zeros(
                (steps + 1, self.grid, TIMING_FIELDS), dtype=torch.int64, device=self.device
            )

    def run_phase(self, phase: int, layer: int, state: Any, pos: int, tokens: list[int]) -> None:
        """Launch one phase alone (the per-phase tests); raises on a kernel-reported error."""
        self.bind(state, pos + self.tokens_per_launch, tokens=self.tokens_per_launch)
        self._set_ctrl(pos, tokens)
        self._launch("mk_phase", self.tokens_per_launch, (np.int32(phase), np.int32(layer)))
        self._check(self.ctrl.cpu())

    def barrier_test(self, rounds: int, skip_block: int, timeout_s: float) -> tuple[int, list[int]]:
        """Run the barrier alone; returns (error code, arrivals per round)."""
        arrivals = torch.zeros(rounds, dtype=torch.int32, device=self.device)
        self.reset()
        self._launch_raw(
            self._build(self.tokens_per_launch),
            "mk_barrier_test",
            (
                np.uint64(_ptr(self.ctrl)),
                np.uint64(_ptr(self.sync)),
                np.uint64(_ptr(arrivals)),
                np.int32(rounds),
                np.int32(skip_block),
                np.int64(int(timeout_s * 1e9)),
            ),
            smem=0,
        )
        ctrl = self.ctrl.cpu()
        code = int(ctrl[self.ctrl_slots["CTRL_ERR"]])
        self.reset()
        return code, [int(x) for x in arrivals.cpu()]

    def phase_stamps(self) -> np.ndarray:
        """The last launch's per-phase stamps, [phases of a step, grid, (start, end)] in ns (timing builds)."""
        return self._stamps()[:, :, :2].copy()

    def gemv_stamps(self) -> np.ndarray:
        """The last launch's GEMV stamps, [phases of a step, grid, (stream start, last round's stream end)] in ns;
        0 where the block ran no GEMV in the phase (timing builds)."""
        return self._stamps()[:, :, 2:].copy()

    def block_sms(self) -> np.ndarray:
        """The SM each block of the last launch ran on, [grid] (timing builds)."""
        return self._timing_rows()[-1, :, 0].copy()

    def _stamps(self) -> np.ndarray:
        return self._timing_rows()[:-1]

    def _timing_rows(self) -> np.ndarray:
        if self._timing is None:
            raise MegakernelError("phase stamps need a runner built with Tuning(phase_timing=True)")
        torch.cuda.synchronize(self.device)
        return self._timing.cpu().numpy()

    def describe(self, n_tokens: int | None = None) -> dict[str, Any]:
        """The build for `n_tokens` tokens per launch (default: the runner's): grid, shared memory, ring, registers."""
        build = self._build(self.tokens_per_launch if n_tokens is None else n_tokens)
        plan = build.plan
        return {
            "tokens_per_launch": plan.tokens_per_launch,
            "grid": self.grid,
            "threads": plan.tuning.threads,
            "smem_bytes": plan.smem_bytes,
            "compile_s": round(build.built.compile_s, 2),
            "dn_split": plan.dn_split,
            "stages": plan.stages,
            "part_rows": plan.part_rows,
            "window": plan.window,
            "fp32_act": plan.tuning.fp32_act,
            "mma": plan.tuning.mma,
            "smem_limit": plan.smem_limit,
            **build.built.resources("mk_decode"),
        }
