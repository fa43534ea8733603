"""Device memory of the megakernel engine on a quantized 27B-shaped model at a long context (issue 21: "under 23 GB,
so it fits a 24 GB card"), measured, beside worker/memory.py's accounting of the same model.

    PYTHONPATH=/tmp/onestream-pkg python3 tools/gpu/quant_memory.py --preset q4_k_m --context 32768

A random model of the 27B shapes (64 layers, MTP head) with every matrix, the embedding included, in fresh random
GGUF blocks of the preset's per-tensor types (kernels/random_quant.py: what a Q4_K_M file holds), on the megakernel
back end as the engine runs it: the runner (repacked weights, which the reference then reads: one copy), the builds
of 1..k+1 tokens per launch, one sequence state of `--context` positions filled by the fast prefill, decode steps, a
verify of k + 1 tokens recording its DeltaNet states, MTP drafts, a rollback. Reported: the torch allocator's peak
(allocated and reserved) of each stage -- the random model's generation (this tool's, not the engine's: the peak
statistics are reset once the model exists) and the engine's stages after it, whose largest is the engine's peak --,
what the runner holds itself (its buffers, the repacked weights: the quantized embedding table among them, whose
rows the kernel decodes, with no bf16 copy), CuPy's pool, and the device's used memory (CUDA context and
modules included), against the target. Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from typing import Any

import torch

GIB = 1 << 30
TARGET_BYTES = 23 * 10**9  # issue 21: under 23 GB


def quantized_27b(layers: int, preset: str, device: torch.device) -> tuple[object, dict[str, str]]:
    from onestream.kernels.random_model import config_27b, random_model
    from onestream.kernels.random_quant import preset_types, quantize_randomly, random_blocks
    from onestream.worker.quant import QuantizedWeight, install_quantized_weights

    model = random_model(config_27b(layers, mtp=True), seed=0, device=device)
    pick = preset_types(model, preset)
    chosen = {n: t.name for n, t in quantize_randomly(model, pick, seed=1).items()}
    embed = model.model.embed_tokens
    if not model.config.tie_word_embeddings:  # a GGUF's token_embd is quantized too (Q4_K in a Q4_K_M file)
        shape = (int(embed.weight.shape[0]), int(embed.weight.shape[1]))
        qtype = pick("model.embed_tokens.weight", shape)
        g = torch.Generator(device=device).manual_seed(2)
        raw = random_blocks(qtype, shape, generator=g, device=device)
        install_quantized_weights(
            model, {"model.embed_tokens.weight": QuantizedWeight(qtype, shape, raw)}, dtype=torch.bfloat16
        )
        chosen["model.embed_tokens.weight"] = qtype.name
    return model, chosen


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", default="q4_k_m")
    parser.add_argument("--layers", type=int, default=64)
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--prompt", type=int, default=None, help="prefill tokens (default: context - 64)")
    parser.add_argument("--spec-k", type=int, default=3, help="drafts per verify (k + 1 tokens per launch)")
    parser.add_argument(
        "--piece",
        type=int,
        default=None,
        help="fast-prefill piece ($ONESTREAM_PREFILL_TOKENS; default: the engine's)",
    )
    parser.add_argument(
        "--card-memory",
        type=float,
        default=None,
        help="a card's memory in bytes (24e9: a 24 GB card): the engine's choice of the piece plans with it "
        "instead of this device's memory, and the measured peak is reported against it",
    )
    args = parser.parse_args()
    from onestream.worker.prefill.runner import PIECE_ENV

    if args.piece is not None:  # the operator's piece, which the engine's choice leaves alone
        os.environ[PIECE_ENV] = str(args.piece)

    from onestream.kernels.backend import MegakernelBackend
    from onestream.worker.memory import device_memory, fit_prefill_pieces, preset_weight_types

    device = torch.device("cuda")
    torch.cuda.init()
    free0, total = torch.cuda.mem_get_info(device)
    clock = time.perf_counter()

    peaks: dict[str, tuple[int, int]] = {}  # stage -> (allocated peak, reserved peak) within the stage

    # A line per stage (a run cut short by its time limit still says something), and the stage's own peaks.
    def stage(what: str, key: str) -> None:
        torch.cuda.synchronize()
        stats = torch.cuda.memory_stats()
        peaks[key] = (stats["allocated_bytes.all.peak"], stats["reserved_bytes.all.peak"])
        print(
            f"[{time.perf_counter() - clock:6.1f} s] {what}: allocated {stats['allocated_bytes.all.current'] / 1e9:.2f} "
            f"GB, peak {stats['allocated_bytes.all.peak'] / 1e9:.2f}, reserved peak "
            f"{stats['reserved_bytes.all.peak'] / 1e9:.2f}, device used {(total - torch.cuda.mem_get_info()[0]) / 1e9:.2f}",
            flush=True,
        )
        torch.cuda.reset_peak_memory_stats()  # the next stage's peak is its own

    model, chosen = quantized_27b(args.layers, args.preset, device)
    config = model.config
    stage(f"random model made ({sorted(set(chosen.values()))}; the tool's temporaries)", "model_generation")
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    model_bytes = torch.cuda.memory_allocated()
    k = args.spec_k
    types = preset_weight_types(config, args.preset)
    plan = device_memory(config, types, args.context, spec_k=k, prefill_tokens=None, megakernel=True)

    backend = MegakernelBackend(model)
    runner = backend.runner
    after_runner = torch.cuda.memory_allocated()
    stage("runner (weights repacked, the T = 1 build; the fast prefill's scratch resized)", "runner")
    # the piece as the engine chooses it (worker/memory.py), for --card-memory rather than this device's memory
    budget = int(args.card_memory) if args.card_memory is not None else None
    fit_prefill_pieces(backend, types, args.context, drafts=k, budget=budget)
    print(
        f"prefill piece {backend.prefill_tokens} (delta rule {backend.fast_prefill.delta_rule.name})",
        flush=True,
    )
    plan = device_memory(
        config,
        types,
        args.context,
        spec_k=k,
        prefill_tokens=backend.prefill_tokens,
        megakernel=True,
        delta_rule=backend.fast_prefill.delta_rule.name,
    )
    print(f"accounting (worker/memory.py, megakernel): {plan.format()}", flush=True)
    state = backend.new_state(args.context)
    prompt_len = args.prompt or args.context - 64
    g = torch.Generator(device=device).manual_seed(5)
    ids = torch.randint(0, config.vocab_size, (prompt_len,), device=device, generator=g)
    piece = backend.prefill_tokens
    for p0 in range(0, prompt_len, piece):  # in the engine's pieces, as Sequence.feed runs a prompt
        out = backend.prefill(ids[p0 : p0 + piece], state)
    stage(f"prefill of {prompt_len} tokens in pieces of {piece}", "prefill")
    token = out.logits[-1].argmax().reshape(1)
    steps, times = 8, []
    for _ in range(steps):  # greedy steps, each read back (a sanity figure of the build's speed, not a bench)
        begin = time.perf_counter()
        step = backend.decode(token, state)
        token = step.logits[-1].argmax().reshape(1)
        times.append(time.perf_counter() - begin)
    ms = 1e3 * sorted(times[1:])[len(times[1:]) // 2]
    # What a verify of k + 1 tokens records (its build compiles below, if time allows).
    runner._reserve_history(k)
    stage(
        f"{steps} decode steps (median {ms:.2f} ms at {state.length} positions); the history of a {k + 1}-token verify",
        "decode",
    )
    report(args, runner, backend, model, state, plan, model_bytes, after_runner, free0, total, chosen, peaks)
    try:  # a verify of k + 1 tokens recording its states, a rollback, an MTP draft step (the engine's cycle)
        drafts = torch.randint(0, config.vocab_size, (k,), device=device, generator=g)
        verify, accepted, _, _ = backend.verify_greedy(torch.cat((token, drafts)), state)
        backend.rollback(state, k - accepted)
        pairs = torch.randint(0, config.vocab_size, (1,), device=device, generator=g)
        backend.draft(pairs, verify.hidden[accepted : accepted + 1], state)
        stage(f"a {k + 1}-token verify, a rollback, an MTP draft step", "verify_draft")
    except Exception as e:  # the figures above still say what the steps before it held
        print(f"verify / draft failed: {type(e).__name__}: {e}")
    report(args, runner, backend, model, state, plan, model_bytes, after_runner, free0, total, chosen, peaks)


def report(
    args: argparse.Namespace,
    runner: Any,
    backend: Any,
    model: Any,
    state: Any,
    plan: Any,
    model_bytes: int,
    after_runner: int,
    free0: int,
    total: int,
    chosen: dict[str, str],
    peaks: dict[str, tuple[int, int]],
) -> None:
    import cupy

    device = runner.device
    engine_stages = {k: v for k, v in peaks.items() if k != "model_generation"}
    peak = max(p for p, _ in engine_stages.values())
    reserved_peak = max(r for _, r in engine_stages.values())
    free1, _ = torch.cuda.mem_get_info(device)
    cupy_pool = cupy.get_default_memory_pool().total_bytes()
    buffers = tensor_bytes(
        [*runner.buf.values(), *runner._params.values(), runner.ctrl, runner._globals, runner._layers]
        + [b.sync for b in runner._builds.values()]
        + [runner._att_part, runner._hist, *(runner._hist_stacks or ())]
    )
    measured = {
        "allocator_peak": peak,  # the engine's stages (the model's generation left out)
        "allocator_reserved_peak": reserved_peak,
        **{f"peak_{k}": p for k, (p, _) in peaks.items()},
        **{f"reserved_peak_{k}": r for k, (_, r) in peaks.items()},
        "cupy_pool": cupy_pool,
        "device_used_now": total - free1,
        "device_used_by_process": free0 - free1,
        "model_before_runner": model_bytes,
        "runner_added": after_runner - model_bytes,
        "runner_buffers": buffers,
        "repacked_weights": runner.weights.repacked_bytes,
        "sequence_state": backend.nbytes(state),
    }
    # What the allocator held at its peak plus what lives outside it (CuPy's pool; the CUDA context and modules
    # are in the device's used memory, which the reserved peak bounds from below).
    engine = reserved_peak + cupy_pool
    print(
        f"{args.preset} 27B shapes, {args.layers} layers + MTP, context {args.context}, verify k = {args.spec_k}"
    )
    for name, value in measured.items():
        print(f"  {name:26s} {value / GIB:8.3f} GiB  {value / 1e9:8.3f} GB")
    print(f"  accounting (worker/memory.py): {plan.total / 1e9:.3f} GB: {plan.format()}")
    used = total - free1
    verdict = "under" if max(engine, used) < TARGET_BYTES else "NOT under"
    allocated = peak + cupy_pool
    print(
        f"engine (allocator peak + CuPy pool) {allocated / 1e9:.2f} GB: "
        f"{'under' if allocated < TARGET_BYTES else 'NOT under'} the {TARGET_BYTES / 1e9:.0f} GB target"
        + (
            f"; card memory {args.card_memory / 1e9:.2f} GB: "
            f"{'fits' if max(allocated, reserved_peak + cupy_pool) <= args.card_memory else 'does NOT fit'} "
            f"(reserved peak + CuPy pool {(reserved_peak + cupy_pool) / 1e9:.2f} GB)"
            if args.card_memory
            else ""
        ),
        flush=True,
    )
    print(
        f"engine (reserved peak + CuPy pool) {engine / 1e9:.2f} GB, device used {used / 1e9:.2f} GB: "
        f"{verdict} the {TARGET_BYTES / 1e9:.0f} GB target",
        flush=True,
    )
    print(json.dumps({
        "preset": args.preset, "layers": args.layers, "context": args.context, "spec_k": args.spec_k,
        "device": torch.cuda.get_device_name(device), "measured": measured, "accounting_total": plan.total,
        "accounting_parts": {
            "weights": plan.weights, "kv": plan.kv_cache + plan.mtp_kv_cache, "deltanet": plan.deltanet_state,
            "rollback": plan.rollback_history, "workspace": plan.workspace, "megakernel": plan.kernel_buffers,
        },
        "types": sorted(set(chosen.values())), "target_bytes": TARGET_BYTES,
        "card_memory": args.card_memory, "piece": backend.prefill_tokens, "engine_allocated_peak": allocated,
    }), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
