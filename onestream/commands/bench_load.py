"""`onestream bench load`: the host memory one model load takes, in this process, against the size of its files.

Prints one JSON object: the model's file bytes, the process's resident memory before the load (`baseline_rss`,
after importing torch and the loader and a warm-up load of a tiny model, which pages in ~70 MiB of library
code a first load would otherwise count), its peak during the load (`peak_rss`, /proc's VmHWM reset after the
warm-up), their difference (`added`), the bytes the loaded model holds, the largest tensor's fp32 size, and
`ru_maxrss` as getrusage reports it (on Linux it includes the forking parent's RSS, so it is only an upper
bound). Run it in a fresh process per measurement: memory freed by one load is reused by the next.
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

CLEAR_REFS = Path("/proc/self/clear_refs")


def add_parser(sub: argparse._SubParsersAction) -> None:
    load = sub.add_parser("load", help="peak host memory of a model load (CPU)", description=__doc__)
    load.add_argument("--model", required=True, help="a checkpoint: HF directory or GGUF file")
    load.add_argument(
        "--quantize", default=None, metavar="PRESET", help="quantize while loading (q4_k_m, ...)"
    )
    load.add_argument("--dtype", default="bf16", help="compute dtype (bf16, fp16, fp32)")
    load.add_argument(
        "--dequantize-once",
        choices=("auto", "on", "off"),
        default="off",
        help="quantized layers dequantize once at load (on), per call (off: what a model over the loader's "
        "DEQUANTIZE_ONCE_BYTES does), or as the loader decides for this model's size (auto)",
    )
    load.set_defaults(func=run_load)


def run_load(args: argparse.Namespace) -> int:
    from onestream.worker.engine import parse_dtype
    from onestream.worker.errors import OnestreamError

    once = {"auto": None, "on": True, "off": False}[args.dequantize_once]
    try:
        result = measure_load(args.model, quantize=args.quantize, dtype=parse_dtype(args.dtype), once=once)
    except (OnestreamError, ValueError, OSError) as e:
        print(f"onestream bench load: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result))
    return 0


def measure_load(model: str | Path, *, quantize: str | None, dtype: Any, once: bool | None) -> dict[str, Any]:
    import gguf  # noqa: F401  (paged in before the baseline, as the warm-up's other libraries)

    from onestream.worker.checkpoints import open_checkpoint
    from onestream.worker.layout import expected_tensor_shapes
    from onestream.worker.loading import load_model

    checkpoint = open_checkpoint(model, quantize=quantize)
    file_bytes = checkpoint.format.nbytes
    _warm_up(dtype)
    if CLEAR_REFS.exists():
        CLEAR_REFS.write_text("5")  # VmHWM := VmRSS: the peak from here on
    baseline = _status_bytes("VmRSS")
    start = time.monotonic()
    loaded = load_model(checkpoint, dtype=dtype, device="cpu", dequantize_once=once)
    seconds = time.monotonic() - start
    peak = _status_bytes("VmHWM")
    largest = max(math.prod(shape) for shape in expected_tensor_shapes(checkpoint.config).values())
    return {
        "model": str(model),
        "format": checkpoint.format.label,
        "file_bytes": file_bytes,
        "baseline_rss": baseline,
        "peak_rss": peak,
        "added": peak - baseline,
        "model_bytes": _held_bytes(loaded),
        "largest_tensor_fp32": 4 * largest,
        "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "load_s": round(seconds, 2),
    }


def _warm_up(dtype: Any) -> None:
    """Load a tiny model once, quantizing it on load, so that the measured load pays for no library code."""
    from onestream.worker.loading import load_model
    from onestream.worker.testing import write_tiny_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        tiny = write_tiny_checkpoint(Path(tmp) / "tiny")
        load_model(tiny, dtype=dtype, quantize="q8_0", dequantize_once=False)
        load_model(tiny, dtype=dtype)


def _held_bytes(model: Any) -> int:
    """Bytes of every distinct storage the model's parameters and buffers (quantized blocks included) hold."""
    seen: dict[int, int] = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        storage = tensor.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _status_bytes(field: str) -> int:
    """A /proc/self/status memory field in bytes (Linux); 0 where there is no /proc."""
    try:
        with open("/proc/self/status") as f:
            line = next(line for line in f if line.startswith(field + ":"))
    except (OSError, StopIteration):
        return 0
    return int(line.split()[1]) * 1024
