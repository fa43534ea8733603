"""Tiny checkpoints whose MTP head drafts well: random models make speculative tests meaningless
(an untrained MTP head is never accepted, so rollback after a partial acceptance is never exercised).

The main model is made nearly a bigram model (the mixers' and MLPs' output projections are scaled by
`mixing`, so the residual stream is mostly the current token's embedding), and the MTP head's `fc` passes
the next token's embedding through (plus `draft_noise`), with the final norm's weights: its logits are then
close to the main model's at the next position. Small `mixing` and `draft_noise` mean high acceptance; larger
ones lower it. These are real checkpoints run by the real model; nothing is mocked.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import save_file

from .api import Finished, GenerateRequest
from .checkpoints.hf import SINGLE_FILE
from .config import ModelConfig
from .testing import random_weights, tiny_config, write_tiny_checkpoint

if TYPE_CHECKING:
    from .engine import Engine

OUTPUT_PROJECTIONS = ("o_proj.weight", "out_proj.weight", "down_proj.weight")


def draftable_weights(
    config: ModelConfig, *, seed: int = 0, mixing: float = 0.1, draft_noise: float = 0.3
) -> dict[str, torch.Tensor]:
    if not config.has_mtp:
        raise ValueError("draftable weights need a config with an MTP head")
    weights = random_weights(config, seed=seed, peaked=True)
    generator = torch.Generator().manual_seed(seed + 1)
    for name, tensor in weights.items():
        if name.endswith(OUTPUT_PROJECTIONS):
            tensor.mul_(mixing)
    h = config.hidden_size
    passthrough = torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1)
    noise = torch.randn(h, 2 * h, generator=generator) * (draft_noise / math.sqrt(2 * h))
    weights["mtp.fc.weight"] = passthrough + noise
    weights["mtp.pre_fc_norm_embedding.weight"] = torch.zeros(h)
    weights["mtp.norm.weight"] = weights["model.norm.weight"].clone()
    return weights


def write_draftable_checkpoint(
    directory: str | Path,
    *,
    config: ModelConfig | None = None,
    seed: int = 0,
    mixing: float = 0.1,
    draft_noise: float = 0.3,
) -> Path:
    """A complete tiny checkpoint directory (tokenizer included) with `draftable_weights`."""
    config = config or tiny_config()
    directory = write_tiny_checkpoint(directory, config=config, seed=seed)
    weights = draftable_weights(config, seed=seed, mixing=mixing, draft_noise=draft_noise)
    save_file(
        {n: t.contiguous() for n, t in weights.items()},
        str(directory / SINGLE_FILE),
        metadata={"format": "pt"},
    )
    return directory


def generate_ids(engine: Engine, request: GenerateRequest) -> tuple[list[int], Finished]:
    """A request's generated ids and its `Finished` item, through `engine.generate` (the speculative tests'
    way to compare runs)."""
    ids: list[int] = []
    finished = None
    for item in engine.generate(request):
        if isinstance(item, Finished):
            finished = item
        else:
            ids.extend(item.token_ids)
    assert finished is not None, "the engine's stream ended without a Finished item"
    return ids, finished
