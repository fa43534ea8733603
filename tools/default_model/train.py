"""Trains the embedded default model (main model and MTP head jointly) and writes a HF checkpoint.

    python -m tools.default_model.train --out OUT/ckpt --log-dir OUT [--time-budget 360]

Loss per token: next-token cross-entropy of the main model + sum over draft depths d of w_d times the
cross-entropy of the MTP head's depth-d draft (depth 1: token t[p+1] with the main model's post-norm H[p]
predicts t[p+2]; deeper depths feed the MTP layer's own output, as drafting does: see mtp_chain.py).
H[p] is not detached: the MTP objective also shapes the main model's last hidden state so that it carries
what the draft needs about t[p+2] (the draft head is one layer; alone it cannot recover what the trunk
dropped). Its weight stays well below the main loss's so the main model stays first.

Training is bounded by wall-clock time: after a few timed steps the total step count is fixed so that the
cosine schedule ends inside `--time-budget` (or pass `--steps` for an exact, repeatable count). bf16
autocast, fp32 master weights, AdamW, linear warm-up then cosine decay, gradient clipping; seeded
(data order and init are deterministic; GPU kernels are not bitwise deterministic).

Speed (the model is small, so eager PyTorch is bound by launches and memory traffic, not FLOPs): the DeltaNet
recurrence runs in the training-only form of fast_delta.py (same math as the serving reference, tested
against it), and on CUDA each decoder layer and the loss head are compiled with torch.compile
(compiled_step.py; any compiler failure falls back to eager). `--profile-step N` writes where step N's time
goes to profile.txt.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import platform
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
import torch.nn.functional as F
from onestream.worker.model import Qwen35ForCausalLM

from . import architecture, build_data, heldout, step_profile
from .checkpoint import save_checkpoint
from .compiled_step import CompiledStep, HeadLoss
from .fast_delta import chunked_delta_rule_for_training
from .mtp_chain import chained_mtp_forward

LOG_COLUMNS = (
    "step",
    "tokens",
    "lr",
    "loss",
    "main_loss",
    "mtp_losses",
    "grad_norm",
    "elapsed_s",
    "tokens_per_s",
)
PROBE_STEPS = (5, 25)  # steps timed to size the schedule (after warm-up allocations and autotuning)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", choices=sorted(architecture.CONFIGS), default="default")
    p.add_argument("--data", type=Path, default=build_data.DEFAULT_DATA)
    p.add_argument("--tokenizer-dir", type=Path, default=build_data.DEFAULT_ASSETS)
    p.add_argument("--out", type=Path, required=True, help="checkpoint directory to write")
    p.add_argument(
        "--log-dir", type=Path, required=True, help="where train_log.tsv and train_results.json go"
    )
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch", type=int, default=64, help="sequences per optimizer step")
    p.add_argument("--micro-batch", type=int, default=0, help="sequences per forward (0: the whole batch)")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--mtp-weights", default="0.3,0.15,0.1", help="loss weight per draft depth")
    p.add_argument(
        "--time-budget", type=float, default=360.0, help="seconds of training (schedule sized to fit)"
    )
    p.add_argument("--steps", type=int, default=0, help="exact number of steps (overrides the time budget)")
    p.add_argument("--max-train-tokens", type=int, default=0, help="use only the first N training tokens")
    p.add_argument("--eval-batch", type=int, default=32)
    p.add_argument("--eval-max-windows", type=int, default=0)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto")
    p.add_argument(
        "--cpu-autocast", action="store_true", help="bf16 autocast on the CPU too (to test that path)"
    )
    p.add_argument(
        "--compile",
        choices=("auto", "on", "off"),
        default="auto",
        help="torch.compile the training step (auto: on CUDA only); falls back to eager if compiling fails",
    )
    p.add_argument(
        "--delta-rule",
        choices=("fast", "reference"),
        default="fast",
        help="the DeltaNet recurrence for training: fast_delta.py's form or the serving reference",
    )
    p.add_argument(
        "--profile-step", type=int, default=0, help="profile this step (1-based) into profile.txt (0: none)"
    )
    p.add_argument("--note", default="", help="free text recorded in train_results.json (commit, command)")
    return p.parse_args(argv)


class WindowSampler:
    """Epochs over non-overlapping windows of the token stream, in a seeded random order, on the device."""

    def __init__(self, stream: torch.Tensor, seq_len: int, extra: int, seed: int) -> None:
        self.stream = stream
        self.length = seq_len + 1 + extra
        self.count = (stream.numel() - self.length) // seq_len + 1
        self.seq_len = seq_len
        self.generator = torch.Generator().manual_seed(seed)
        self.order = torch.empty(0, dtype=torch.long)
        self.epoch = -1
        self.offsets = torch.arange(self.length, device=stream.device)

    def next(self, n: int) -> torch.Tensor:
        if self.order.numel() < n:
            self.epoch += 1
            self.order = torch.cat((self.order, torch.randperm(self.count, generator=self.generator)))
        chosen, self.order = self.order[:n], self.order[n:]
        starts = chosen.to(self.stream.device) * self.seq_len
        return self.stream[starts[:, None] + self.offsets].long()


def learning_rate(step: int, total: int | None, args: argparse.Namespace) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    if total is None:
        return args.lr
    progress = min(1.0, (step - args.warmup) / max(1, total - args.warmup))
    floor = args.lr * args.min_lr_ratio
    return floor + (args.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def optimizer_for(model: Qwen35ForCausalLM, args: argparse.Namespace, fused: bool) -> torch.optim.AdamW:
    """Weight decay on matrices (and the conv kernels), none on norms and the DeltaNet decay parameters."""
    decay, no_decay = [], []
    for _name, param in model.named_parameters():
        (decay if param.ndim >= 2 else no_decay).append(param)
    groups = [
        {"params": decay, "weight_decay": args.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=fused)


def token_loss(hidden: torch.Tensor, head_weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of the fp32 logits `hidden @ head_weight^T` (as the model computes them)."""
    return F.cross_entropy(F.linear(hidden, head_weight).float().flatten(0, 1), targets.flatten())


def trunk_hidden(model: Qwen35ForCausalLM, input_ids: torch.Tensor) -> torch.Tensor:
    """`model.forward`'s post-norm hidden states without its logits (the loss head computes those)."""
    h = model.model.embed_tokens(input_ids)
    cos, sin = model.rotary(torch.arange(input_ids.shape[1], device=h.device), h.dtype)
    for layer in model.model.layers:
        h = layer(h, cos, sin)
    return model.model.norm(h)


def losses(
    model: Qwen35ForCausalLM,
    x: torch.Tensor,
    seq_len: int,
    weights: list[float],
    head_loss: HeadLoss = token_loss,
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """(weighted total, main CE, CE per draft depth) for windows `x [B, seq_len + 1 + depths]`."""
    hidden = trunk_hidden(model, x[:, :seq_len])
    head = model.lm_head_weight
    main = head_loss(hidden, head, x[:, 1 : seq_len + 1])
    total = main
    per_depth = []
    if weights:
        chain = chained_mtp_forward(model, x[:, 1:], hidden, len(weights), with_logits=False)
        for d, (_, out) in enumerate(chain, 1):
            ce = head_loss(out, head, x[:, d + 1 : d + 1 + seq_len])
            per_depth.append(ce)
            total = total + weights[d - 1] * ce
    return total, main, per_depth


@contextmanager
def training_delta_rule(fast: bool) -> Iterator[None]:
    """While training, the model's DeltaNet layers run the delta rule in fp32 even under autocast (serving
    runs that recurrence in fp32; TF32 on the GPU), in the training-only form of fast_delta.py when `fast`.
    The layer module calls `chunked_delta_rule` by its global name; the original is restored on exit."""
    from onestream.worker.layers import deltanet

    original = deltanet.chunked_delta_rule
    inner = chunked_delta_rule_for_training if fast else original

    def chunked_delta_rule_fp32(*args, **kwargs):  # type: ignore[no-untyped-def]
        with torch.autocast(args[0].device.type, enabled=False):
            return inner(*args, **kwargs)

    deltanet.chunked_delta_rule = chunked_delta_rule_fp32
    try:
        yield
    finally:
        deltanet.chunked_delta_rule = original


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    with training_delta_rule(fast=args.delta_rule == "fast"):
        return train(args)


def train(args: argparse.Namespace) -> dict:
    started = time.time()
    device = torch.device(
        ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    )
    on_cuda = device.type == "cuda"
    if on_cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(args.seed)
    weights = [float(w) for w in args.mtp_weights.split(",") if w.strip()]
    depths = len(weights)

    meta = json.loads((args.data / "meta.json").read_text())
    train_ids = build_data.read_tokens(args.data / "train.u16.xz")
    if args.max_train_tokens:
        train_ids = train_ids[: args.max_train_tokens]
    heldout_ids = build_data.read_tokens(args.data / "heldout.u16.xz")
    train_stream = torch.from_numpy(train_ids.astype("int32")).to(device)
    heldout_stream = torch.from_numpy(heldout_ids.astype("int32")).to(device)
    print(
        f"data: {train_stream.numel()} train / {heldout_stream.numel()} held-out tokens "
        f"({time.time() - started:.1f}s)",
        flush=True,
    )

    config = architecture.CONFIGS[args.config]()
    model = Qwen35ForCausalLM(config).to(device)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    optimizer = optimizer_for(model, args, fused=on_cuda)
    sampler = WindowSampler(train_stream, args.seq_len, depths, args.seed)
    autocast = (
        torch.autocast(device.type, dtype=torch.bfloat16) if on_cuda or args.cpu_autocast else nullcontext()
    )
    use_compile = args.compile == "on" or (args.compile == "auto" and on_cuda)
    step_fn = CompiledStep(model, losses, token_loss, compile=use_compile, autocast=autocast)
    micro = args.micro_batch or args.batch

    args.log_dir.mkdir(parents=True, exist_ok=True)
    log = (args.log_dir / "train_log.tsv").open("w")
    log.write("\t".join(LOG_COLUMNS) + "\n")

    total_steps: int | None = args.steps or None
    step = 0
    tokens_seen = 0
    probe_started = 0.0
    train_started = time.time()
    deadline = train_started + (args.time_budget * 1.05 if not args.steps else float("inf"))
    snapshot = {k: v.detach().clone() for k, v in model.state_dict().items()}
    snapshot_step = 0
    stop_reason = "schedule finished"
    last = {}
    profiled: dict | None = None
    while total_steps is None or step < total_steps:
        if time.time() > deadline:
            stop_reason = "time budget"
            break
        lr = learning_rate(step, total_steps, args)
        for group in optimizer.param_groups:
            group["lr"] = lr
        batch = sampler.next(args.batch)
        profiler = step_profile.start(on_cuda) if step + 1 == args.profile_step else None
        try:
            step_losses = []
            for chunk in batch.split(micro):
                step_losses.append(step_fn(chunk.shape[0] / batch.shape[0], chunk, args.seq_len, weights))
        except torch.cuda.OutOfMemoryError:
            if micro == 1:
                raise
            optimizer.zero_grad(set_to_none=True)
            if profiler is not None:
                profiler.stop()
            micro = max(1, micro // 2)
            print(f"out of memory: micro-batch now {micro}", flush=True)
            torch.cuda.empty_cache()
            continue
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if profiler is not None:
            try:
                profiled = step_profile.finish(profiler, args.log_dir / "profile.txt", on_cuda)
            except Exception as error:  # diagnostics only: never the reason a run is lost
                profiled = {"error": f"{type(error).__name__}: {error}"}
            print(f"profiled step {step + 1}: {profiled}", flush=True)
        step += 1
        tokens_seen += batch.shape[0] * args.seq_len

        if step == PROBE_STEPS[0] or step == PROBE_STEPS[1]:
            if on_cuda:
                torch.cuda.synchronize()
            if step == PROBE_STEPS[0]:
                probe_started = time.time()
            elif total_steps is None:
                per_step = (time.time() - probe_started) / (PROBE_STEPS[1] - PROBE_STEPS[0])
                remaining = args.time_budget - (time.time() - train_started)
                total_steps = step + max(1, int(remaining / per_step * 0.98))
                print(f"{per_step * 1000:.0f} ms/step: {total_steps} steps in the budget", flush=True)
        final = step == total_steps or time.time() > deadline
        if step % args.log_every == 0 or final:
            n = len(step_losses)
            loss_v = sum(s[0].item() for s in step_losses) / n
            main_v = sum(s[1].item() for s in step_losses) / n
            mtp_v = [sum(s[2][d].item() for s in step_losses) / n for d in range(depths)]
            elapsed = time.time() - train_started
            last = {"step": step, "loss": loss_v, "main_loss": main_v, "mtp_losses": mtp_v}
            row = (
                step,
                tokens_seen,
                f"{lr:.3e}",
                f"{loss_v:.4f}",
                f"{main_v:.4f}",
                ",".join(f"{v:.4f}" for v in mtp_v),
                f"{grad_norm.item():.3f}",
                f"{elapsed:.1f}",
                f"{tokens_seen / elapsed:.0f}",
            )
            log.write("\t".join(map(str, row)) + "\n")
            log.flush()
            print(" ".join(f"{k}={v}" for k, v in zip(LOG_COLUMNS, row, strict=True)), flush=True)
            if not math.isfinite(loss_v):
                model.load_state_dict(snapshot)
                stop_reason = f"non-finite loss at step {step}; restored the weights of step {snapshot_step}"
                break
            snapshot = {k: v.detach().clone() for k, v in model.state_dict().items()}
            snapshot_step = step
    train_seconds = time.time() - train_started
    log.close()
    step_mode = step_fn.mode
    step_fn.restore_eager()
    print(f"trained {step} steps, {tokens_seen} tokens in {train_seconds:.0f}s ({stop_reason})", flush=True)

    save_checkpoint(model, args.out, args.tokenizer_dir)
    weights_sha256 = hashlib.sha256((args.out / "model.safetensors").read_bytes()).hexdigest()
    model.to(torch.bfloat16)  # evaluate what was saved
    bytes_per_token = meta["tokens"]["heldout"]["bytes"] / meta["tokens"]["heldout"]["tokens"]
    eval_started = time.time()
    result = heldout.evaluate(
        model,
        heldout_stream,
        seq_len=args.seq_len,
        batch=args.eval_batch,
        depths=depths,
        bytes_per_token=bytes_per_token,
        max_windows=args.eval_max_windows or None,
    )
    print(f"held-out: {json.dumps(result)} ({time.time() - eval_started:.0f}s)", flush=True)
    results = {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "config": config.to_hf_text_dict(),
        "parameters": n_params,
        "steps": step,
        "planned_steps": total_steps,
        "stop_reason": stop_reason,
        "tokens_trained": tokens_seen,
        "epochs": tokens_seen / train_stream.numel(),
        "train_seconds": train_seconds,
        "tokens_per_second": tokens_seen / train_seconds,
        "final_micro_batch": micro,
        "step_mode": step_mode,
        "profiled_step": profiled,
        "compile_fallback_reason": step_fn.fallback_reason,
        "compile_first_step_seconds": step_fn.first_step_seconds,
        "last_logged": last,
        "heldout": result,
        "model_safetensors_sha256": weights_sha256,
        "corpus_list_sha256": meta["list_sha256"],
        "tokenizer_sha256": meta["tokenizer_sha256"],
        "machine": {
            "device": torch.cuda.get_device_name(device) if on_cuda else platform.processor() or "cpu",
            "torch": torch.__version__,
            "python": sys.version.split()[0],
        },
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "wall_seconds": time.time() - started,
    }
    (args.log_dir / "train_results.json").write_text(json.dumps(results, indent=1) + "\n")
    return results


if __name__ == "__main__":
    main()
