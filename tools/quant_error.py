"""Quantization error of our GGUF quantizer per type, against the `gguf` package's quantizer where it has one,
and the quantizer's throughput on a device.

Prints a Markdown table for docs/benchmarks.md: relative RMS error ||dequantize(quantize(W)) - W|| / ||W||
on Gaussian weights and on heavy-tailed ones (Student t, 4 degrees of freedom: trained weights have
outliers), and quantize throughput with the time a 27B model (26.9e9 weights in 2-D tensors) would take.

    python tools/quant_error.py [--device cuda] [--rows 1024] [--cols 4096] [--seed N]
"""

from __future__ import annotations

import argparse
import datetime
import platform
import subprocess
import time

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants
from onestream.worker.quant import QuantType, dequantize, quantize

WEIGHTS_27B = (
    26.9e9  # the 2-D weights of the 27B shapes with the MTP head (tests/test_quant_presets.py's plan)
)
GGUF_QUANTIZERS = (QuantType.Q8_0, QuantType.Q4_0, QuantType.Q5_0, QuantType.Q5_1)
BLOCK_TYPES = [t for t in QuantType if not t.is_float]


def relative_error(qtype: QuantType, weights: torch.Tensor) -> float:
    back = dequantize(qtype, quantize(qtype, weights), weights.shape)
    return float((back - weights).norm() / weights.norm())


def gguf_relative_error(qtype: QuantType, weights: torch.Tensor) -> float:
    w = weights.cpu().numpy()
    gtype = GGMLQuantizationType(qtype.value)
    back = gguf_quants.dequantize(gguf_quants.quantize(w, gtype), gtype)
    return float(np.linalg.norm(back - w) / np.linalg.norm(w))


def throughput(qtype: QuantType, weights: torch.Tensor) -> float:
    """Weights per second that `quantize` turns into blocks on `weights`' device (after one warm-up call)."""
    quantize(qtype, weights)
    if weights.is_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    quantize(qtype, weights)
    if weights.is_cuda:
        torch.cuda.synchronize()
    return weights.numel() / (time.perf_counter() - start)


def machine(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}"
    return f"{platform.processor() or platform.machine()} CPU, {torch.get_num_threads()} threads, torch {torch.__version__}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--cols", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    seed = args.seed if args.seed is not None else int(torch.seed() % 2**31)
    generator = torch.Generator().manual_seed(seed)
    gaussian = torch.randn(args.rows, args.cols, generator=generator) * 0.02
    t_dist = torch.distributions.StudentT(4.0)
    torch.manual_seed(seed)
    heavy = t_dist.sample((args.rows, args.cols)) * 0.02
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"{when}, commit {commit}, {machine(device)}; {args.rows} x {args.cols} weights, seed {seed}")
    print()
    print(
        "| type | bits/weight | Gaussian: ours | gguf | t(4): ours | gguf | quantize Melem/s | 27B at that rate |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for qtype in BLOCK_TYPES:
        bits = 8 * qtype.type_size / qtype.block_size
        cells = []
        for weights in (gaussian, heavy):
            cells.append(f"{relative_error(qtype, weights.to(device)):.5f}")
            cells.append(f"{gguf_relative_error(qtype, weights):.5f}" if qtype in GGUF_QUANTIZERS else "-")
        rate = throughput(qtype, gaussian.to(device))
        print(
            f"| {qtype.name} | {bits:.4g} | {' | '.join(cells)} | {rate / 1e6:.1f} | {WEIGHTS_27B / rate:.0f} s |"
        )


if __name__ == "__main__":
    main()
