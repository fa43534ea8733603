"""Peak host memory of a quantized load (`onestream bench load`, a fresh process each): a GGUF file and a bf16
checkpoint quantized on load grow the process by about the quantized weights, never by a full-precision copy
of the whole model."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from onestream.worker.checkpoints import open_checkpoint
from onestream.worker.checkpoints.gguf_writer import write_gguf
from onestream.worker.config import default_layer_types
from onestream.worker.layout import expected_tensor_shapes
from onestream.worker.quant import QuantType
from onestream.worker.quant.codec import CHUNK_ELEMENTS
from onestream.worker.testing import tiny_config, write_tiny_checkpoint

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc"),
]
MIB = 2**20
# What a load may add besides the weights it keeps: a few tensors in fp32 at once (the one being read, its
# fp32 copy), the quantizer's temporaries of a chunk of rows when it quantizes on load, and the allocator's
# slack. A whole-model copy in bf16 (13 MiB here) or fp32 (26 MiB) is beyond it.
TENSORS_IN_FLIGHT = 4
CHUNK_TEMPORARIES = 8 * CHUNK_ELEMENTS["cpu"] * 4  # fp32 chunks the block encoders hold at once
SLACK = 4 * MIB
# glibc raises its mmap threshold to the size of each large block freed, so that later temporaries of that
# size stay in the heap when freed: up to ~15 MiB more or less RSS from run to run, nothing the loader holds.
# A fixed threshold gives large blocks back at once.
STEADY_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}
# 8 layers of rows of 256 (every K-quant applies): 6.5M parameters in many tensors, so that one tensor is
# small next to the whole model.
CONFIG = tiny_config(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=8,
    layer_types=default_layer_types(8, 4),
    num_attention_heads=2,
    head_dim=128,
    linear_num_key_heads=2,
    linear_num_value_heads=2,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
)


def gguf_q8_0(qtype: QuantType, weights: torch.Tensor) -> torch.Tensor:
    """`gguf`'s numpy Q8_0 quantizer: the file in a second (ours searches; its speed is not what is tested)."""
    raw = gguf.quants.quantize(weights.float().cpu().numpy(), gguf.GGMLQuantizationType[qtype.name])
    return torch.from_numpy(np.ascontiguousarray(raw))


def q8_0_matrices(name: str, shape: tuple[int, ...], block: int | None) -> QuantType:
    return QuantType.F32 if len(shape) < 2 or "ssm_conv1d" in name else QuantType.Q8_0


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("load_memory")
    hf_dir = write_tiny_checkpoint(root / "bf16", config=CONFIG, dtype=torch.bfloat16)
    path = write_gguf(open_checkpoint(hf_dir), root / "q8_0.gguf", choose=q8_0_matrices, quantizer=gguf_q8_0)
    return hf_dir, path


def bench_load(model: Path, *extra: str) -> dict[str, Any]:
    result = subprocess.run(
        [sys.executable, "-m", "onestream", "bench", "load", "--model", str(model), *extra],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env=os.environ | STEADY_MALLOC,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("source", ["gguf", "quantize"])
def test_a_quantized_load_grows_by_its_weights_not_the_whole_model(
    models: tuple[Path, Path], source: str
) -> None:
    hf_dir, gguf_file = models
    stats = bench_load(gguf_file) if source == "gguf" else bench_load(hf_dir, "--quantize", "q8_0")
    numel = sum(math.prod(s) for s in expected_tensor_shapes(CONFIG).values())
    kept, added = stats["model_bytes"], stats["added"]
    assert kept < 0.4 * numel * 4  # the weights stayed quantized (Q8_0: 1.06 bytes a weight)
    quantizer = CHUNK_TEMPORARIES if source == "quantize" else 0
    bound = kept + TENSORS_IN_FLIGHT * stats["largest_tensor_fp32"] + quantizer + SLACK
    assert added >= 0.5 * kept, stats  # the measurement sees the weights
    assert added <= bound, (
        f"{source}: the load added {added / MIB:.1f} MiB for {kept / MIB:.1f} MiB of weights "
        f"(bound {bound / MIB:.1f} MiB; the whole model in bf16 is {numel * 2 / MIB:.1f} MiB)"
    )
