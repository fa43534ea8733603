"""Times quantize-on-load on a GPU: the issue's "a 27B model in under a minute" (unmeasured until this runs).

    python tools/gpu/quantize_on_load.py --preset q4_k_m                 # 27B shapes, random bf16 on the device
    python tools/gpu/quantize_on_load.py --preset q4_k_m --model DIR     # a real bf16 checkpoint, whole load
    python tools/gpu/quantize_on_load.py --preset q4_k_m --write-random DIR --layers 64   # write one, then load it

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


def write_random_checkpoint(
    directory: str, layers: int, shard_bytes: int = 4 << 30, device: str = "cuda"
) -> dict[str, object]:
    """A bf16 Hugging Face checkpoint of the 27B shapes with `layers` layers (MTP head included), drawn on the
    GPU and written as safetensors shards of about `shard_bytes`, so that the whole load can be timed."""
    from pathlib import Path

    from onestream.kernels.random_model import config_27b
    from onestream.worker.loading import expected_tensor_shapes
    from onestream.worker.testing import _write_json, _write_tokenizer_files, byte_level_tokenizer
    from safetensors.torch import save_file

    config = config_27b(layers, mtp=True)
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator(device=device).manual_seed(0)
    start = time.perf_counter()
    shard: dict[str, torch.Tensor] = {}
    shard_names: list[list[str]] = []
    total = in_shard = 0

    def flush() -> None:
        nonlocal in_shard
        in_shard = 0
        shard_names.append(list(shard))
        save_file(shard, str(out / f"part-{len(shard_names)}.safetensors"), metadata={"format": "pt"})
        shard.clear()

    for name, shape in expected_tensor_shapes(config).items():
        scale = 1.0 / shape[-1] ** 0.5
        tensor = torch.randn(shape, generator=generator, device=device, dtype=torch.bfloat16) * scale
        shard[name] = tensor.cpu()
        total += tensor.numel() * 2
        in_shard += tensor.numel() * 2
        if in_shard >= shard_bytes:
            flush()
    if shard:
        flush()
    count = len(shard_names)
    weight_map = {}
    for i, names in enumerate(shard_names, 1):
        final = f"model-{i:05d}-of-{count:05d}.safetensors"
        (out / f"part-{i}.safetensors").rename(out / final)
        weight_map |= dict.fromkeys(names, final)
    _write_json(
        out / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map}
    )
    _write_json(out / "config.json", config.to_hf_text_dict())
    _write_tokenizer_files(out, byte_level_tokenizer(), config)
    return {"written_bytes": total, "layers": layers, "write_seconds": time.perf_counter() - start}


def drop_page_cache() -> bool:
    """Evict the file cache (root only) so that the load reads the disk, as a first start does."""
    import os

    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


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
    parser.add_argument(
        "--write-random",
        metavar="DIR",
        default=None,
        help="write a random bf16 checkpoint to DIR, then load it",
    )
    parser.add_argument("--layers", type=int, default=64, help="layers of the --write-random checkpoint")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    device = torch.device(args.device)
    written: dict[str, object] = {}
    if args.write_random:
        written = write_random_checkpoint(args.write_random, args.layers)
        written["page_cache_dropped"] = drop_page_cache()
        args.model = args.write_random
    result = whole_load(args.model, args.preset, device) if args.model else random_27b(args.preset, device)
    result |= written
    result |= {"preset": args.preset, "device": torch.cuda.get_device_name(device), "target_seconds": 60}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
