"""Peak host memory of loading a quantized model, against the size of its file (issue 20: "peak host memory stays
near the file's size; nothing is expanded to a full-precision copy of the whole model").

Builds a random model whose rows are multiples of 256 (so that the K-quants apply), writes it as a bf16
safetensors checkpoint, quantizes that with `onestream quantize` to a GGUF, then loads, each in a fresh
process (`onestream bench load`): the bf16 checkpoint as it is, the GGUF, and the bf16 checkpoint with
`--quantize`. Prints one row per load and, with --json, writes every figure.

    python tools/load_memory.py --out /tmp/load_memory            # ~240 MB bf16, Q4_K_M
    python tools/load_memory.py --layers 4 --type q8_0 --out DIR  # quicker
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

MIB = 2**20


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True, help="folder for the checkpoint and the GGUF")
    parser.add_argument("--hidden", type=int, default=1024, help="hidden size (a multiple of 256)")
    parser.add_argument("--intermediate", type=int, default=2816, help="MLP width (a multiple of 256)")
    parser.add_argument("--layers", type=int, default=8, help="main layers (every 4th full attention)")
    parser.add_argument("--type", default="q4_k_m", help="the quantization preset")
    parser.add_argument("--json", type=Path, default=None, help="write the figures to this JSON file")
    args = parser.parse_args()
    if args.layers % min(4, args.layers):
        parser.error(f"--layers must be a multiple of 4 (or fewer than 4), got {args.layers}")
    for name in ("hidden", "intermediate"):
        if getattr(args, name) % 256:
            parser.error(f"--{name} must be a multiple of 256 (K-quant blocks), got {getattr(args, name)}")

    hf_dir = args.out / "bf16"
    gguf_file = args.out / f"{args.type}.gguf"
    if not (hf_dir / "config.json").is_file():
        write_model(hf_dir, args.hidden, args.intermediate, args.layers)
    quantize_s = None
    if not gguf_file.is_file():
        start = time.monotonic()
        onestream("quantize", "--model", str(hf_dir), "--type", args.type, "--out", str(gguf_file))
        quantize_s = time.monotonic() - start
    rows = [
        ("bf16 safetensors", measure(hf_dir)),
        (f"GGUF {args.type}", measure(gguf_file)),
        (f"bf16 --quantize {args.type}", measure(hf_dir, "--quantize", args.type)),
    ]
    print(table(rows))
    if args.json is not None:
        figures = {"config": vars(args) | {"out": str(args.out), "json": str(args.json)}}
        figures |= {"quantize_s": quantize_s, "loads": {label: r for label, r in rows}}
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return 0


def write_model(directory: Path, hidden: int, intermediate: int, layers: int) -> None:
    import torch
    from onestream.worker.config import default_layer_types
    from onestream.worker.testing import tiny_config, write_tiny_checkpoint

    heads = hidden // 128
    config = tiny_config(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        # every 4th layer full attention, as the 27B; GGUF metadata holds only a whole interval
        layer_types=default_layer_types(layers, min(4, layers)),
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 4),
        head_dim=128,
        linear_num_key_heads=heads,
        linear_num_value_heads=heads,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
    )
    write_tiny_checkpoint(directory, config=config, dtype=torch.bfloat16)


def onestream(*argv: str) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "onestream", *argv], capture_output=True, text=True, check=False
    )
    if result.returncode != 0:
        raise SystemExit(f"onestream {' '.join(argv)} failed ({result.returncode}):\n{result.stderr}")
    return result.stdout


def measure(model: Path, *extra: str) -> dict[str, Any]:
    out = onestream("bench", "load", "--model", str(model), *extra)
    return json.loads(out.strip().splitlines()[-1])


def table(rows: list[tuple[str, dict[str, Any]]]) -> str:
    lines = [
        f"{'load':32} {'file MiB':>9} {'held MiB':>9} {'added MiB':>10} {'added/file':>10} "
        f"{'baseline MiB':>12} {'ru_maxrss MiB':>13} {'load s':>7}"
    ]
    for label, r in rows:
        lines.append(
            f"{label:32} {r['file_bytes'] / MIB:9.1f} {r['model_bytes'] / MIB:9.1f} {r['added'] / MIB:10.1f} "
            f"{r['added'] / r['file_bytes']:10.2f} {r['baseline_rss'] / MIB:12.1f} "
            f"{r['ru_maxrss'] / MIB:13.1f} {r['load_s']:7.1f}"
        )
    largest = rows[0][1]["largest_tensor_fp32"]
    lines.append(f"largest tensor in fp32: {largest / MIB:.1f} MiB")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
