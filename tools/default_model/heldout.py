"""Teacher-forced evaluation on the held-out token stream: loss, perplexity, MTP losses and agreement.

The stream (held-out files, each followed by <|endoftext|>) is cut into consecutive windows of `seq_len`
predicted tokens; every token after a window's first is scored once, with the context of its window.
`mtp_agree[d]` is the fraction of positions where the depth-d draft equals the main model's own top-1 at
that position (both teacher-forced): a proxy for greedy acceptance, not the engine's measurement.
"""

from __future__ import annotations

import math
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from onestream.worker.model import Qwen35ForCausalLM

from .mtp_chain import chained_mtp_forward


def windows(stream: torch.Tensor, seq_len: int, extra: int) -> torch.Tensor:
    """`[N, seq_len + 1 + extra]` consecutive windows with stride `seq_len` (the tail that does not fit is left out)."""
    length = seq_len + 1 + extra
    count = (stream.numel() - length) // seq_len + 1
    if count < 1:
        raise ValueError(f"held-out stream of {stream.numel()} tokens is shorter than one window ({length})")
    starts = torch.arange(count, device=stream.device) * seq_len
    return stream[starts[:, None] + torch.arange(length, device=stream.device)]


@torch.no_grad()
def evaluate(
    model: Qwen35ForCausalLM,
    stream: torch.Tensor,
    *,
    seq_len: int,
    batch: int,
    depths: int,
    bytes_per_token: float | None = None,
    max_windows: int | None = None,
    autocast: bool = False,
) -> dict:
    was_training = model.training
    model.eval()
    data = windows(stream, seq_len, depths)
    if max_windows is not None:
        data = data[:max_windows]
    device = model.device
    totals = {"main_nll": 0.0, "main_correct": 0.0, "tokens": 0}
    mtp_nll = [0.0] * depths
    mtp_correct = [0.0] * depths
    mtp_agree = [0.0] * depths
    chain_agree = [0.0] * depths
    context = torch.autocast("cuda", dtype=torch.bfloat16) if autocast else nullcontext()
    for i in range(0, data.shape[0], batch):
        x = data[i : i + batch].to(device=device, dtype=torch.long)
        with context:
            logits, hidden = model(x[:, :seq_len])
            chain = chained_mtp_forward(model, x[:, 1:], hidden, depths) if depths else []
        targets = x[:, 1 : seq_len + 1]
        totals["main_nll"] += F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum").item()
        main_top1 = logits.argmax(-1)
        totals["main_correct"] += (main_top1 == targets).sum().item()
        totals["tokens"] += targets.numel()
        # positions j whose depth-d target t[j+d+1] lies inside the main model's scored range
        all_agree = None
        for d, (draft_logits, _) in enumerate(chain, start=1):
            valid = seq_len - d
            draft = draft_logits[:, :valid]
            target = x[:, d + 1 : d + 1 + valid]
            mtp_nll[d - 1] += (
                F.cross_entropy(draft.flatten(0, 1), target.flatten(), reduction="sum").item() / valid
            )
            draft_top1 = draft.argmax(-1)
            mtp_correct[d - 1] += (draft_top1 == target).float().mean(-1).sum().item()
            agree = draft_top1 == main_top1[:, d : d + valid]
            mtp_agree[d - 1] += agree.float().mean(-1).sum().item()
            all_agree = agree if all_agree is None else all_agree[:, : agree.shape[1]] & agree
            chain_agree[d - 1] += all_agree.float().mean(-1).sum().item()
    n_windows = data.shape[0]
    loss = totals["main_nll"] / totals["tokens"]
    result = {
        "windows": n_windows,
        "seq_len": seq_len,
        "tokens_scored": totals["tokens"],
        "loss": loss,
        "perplexity": math.exp(loss),
        "top1_accuracy": totals["main_correct"] / totals["tokens"],
        "mtp_loss": [v / n_windows for v in mtp_nll],
        "mtp_top1_accuracy": [v / n_windows for v in mtp_correct],
        "mtp_agree_with_main_top1": [v / n_windows for v in mtp_agree],
        "mtp_chain_agree_with_main_top1": [v / n_windows for v in chain_agree],
    }
    if bytes_per_token:
        result["bits_per_byte"] = loss / math.log(2) / bytes_per_token
    model.train(was_training)
    return result
