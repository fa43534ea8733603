"""Times quantize-on-load on a GPU: the issue's "a 27B model in under a minute" (unmeasured until this runs).

    python tools/gpu/quantize_on_load.py --preset q4_k_m                 # 27B shapes, random bf16 on the device
    python tools/gpu/quantize_on_load.py --preset q4_k_m --model DIR     # a real bf16 checkpoint, whole load

Without --model every tensor of the 27B shapes (MTP head included) is drawn in bf16 on the device and quantized
with the preset's per-tensor types, one at a time, as `--quantize` does after reading it: the quantizer's share
of the load. With --model the whole `load_model(DIR, quantize=PRESET, device=cuda)` is timed: reading the
safetensors shards, copying each tensor to the device, quantizing it there. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def random_27b(preset: str, device: torch.device) -> dict[str, object]:
    from onestream.kernels.random_model import config_27b
    from onestream.worker.loading import expected_tensor_shapes
    from onestream.worker.memory import preset_weight_types
    from onestream.worker.quant import QuantType, quantize

    config = config_27b(mtp=True)
    types = preset_weight_types(config, preset)
    generator = torch.Generator(device=device).manual_seed(0)
    quantized_bytes = source_bytes = 0
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for name, shape in expected_tensor_shapes(config).items():
        weights = torch.randn(shape, generator=generator, device=device, dtype=torch.bfloat16)
        source_bytes += weights.numel() * 2
        qtype = QuantType[types[name]]
        if not qtype.is_float:
            quantized_bytes += quantize(qtype, weights.float()).numel()
    torch.cuda.synchronize(device)
    return {
        "what": "27B shapes, random bf16 drawn on the device, quantize only",
        "seconds": time.perf_counter() - start,
        "source_bytes": source_bytes,
        "quantized_bytes": quantized_bytes,
    }


def whole_load(model_dir: str, preset: str, device: torch.device) -> dict[str, object]:
    from onestream.worker.loading import load_model
    from onestream.worker.quant import quantized_nbytes

    start = time.perf_counter()
    model = load_model(model_dir, dtype=torch.bfloat16, device=device, quantize=preset, dequantize_once=False)
    torch.cuda.synchronize(device)
    return {
        "what": f"load_model({model_dir}, quantize={preset})",
        "seconds": time.perf_counter() - start,
        "quantized_bytes": quantized_nbytes(model),
        "peak_device_bytes": torch.cuda.max_memory_allocated(device),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", default="q4_k_m")
    parser.add_argument(
        "--model", default=None, help="a bf16 Hugging Face checkpoint (default: random 27B shapes)"
    )
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    device = torch.device(args.device)
    result = whole_load(args.model, args.preset, device) if args.model else random_27b(args.preset, device)
    result |= {"preset": args.preset, "device": torch.cuda.get_device_name(device), "target_seconds": 60}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
