"""Writing a trained model as a Hugging Face checkpoint directory (what `load_model` and transformers read)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from onestream.worker.model import Qwen35ForCausalLM
from safetensors.torch import save_file

from .architecture import END_OF_TEXT_ID, IM_END_ID

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
# The DeltaNet decay parameters are kept in fp32 (the model computes them in fp32; they are tiny).
FP32_SUFFIXES = (".A_log", ".dt_bias")


def checkpoint_tensors(model: Qwen35ForCausalLM) -> dict[str, torch.Tensor]:
    """HF-named tensors: bf16, except the DeltaNet decay parameters; a tied lm_head is not stored."""
    tensors = {}
    for name, value in model.state_dict().items():
        dtype = torch.float32 if name.endswith(FP32_SUFFIXES) else torch.bfloat16
        tensors[name] = value.detach().to(device="cpu", dtype=dtype).contiguous().clone()
    return tensors


def config_dict(model: Qwen35ForCausalLM) -> dict:
    config = model.config.to_hf_text_dict()
    config["dtype"] = "bfloat16"
    return config


# Greedy by default, with a mild repetition penalty: without it the small model's greedy continuations fall
# into loops (`import os` -> `from distutils import log` forever); 1.15 keeps legitimate repeats (names,
# indentation) while breaking those loops (samples compared in docs/benchmarks.md).
DEFAULT_REPETITION_PENALTY = 1.15


def generation_config() -> dict:
    return {
        "eos_token_id": [END_OF_TEXT_ID, IM_END_ID],
        "pad_token_id": END_OF_TEXT_ID,
        "bos_token_id": None,
        "do_sample": False,
        "repetition_penalty": DEFAULT_REPETITION_PENALTY,
    }


def save_checkpoint(model: Qwen35ForCausalLM, out_dir: Path, tokenizer_dir: Path | None) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(checkpoint_tensors(model), str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config_dict(model), indent=2) + "\n")
    (out_dir / "generation_config.json").write_text(json.dumps(generation_config(), indent=2) + "\n")
    if tokenizer_dir is not None:
        for name in TOKENIZER_FILES:
            if (tokenizer_dir / name).resolve() != (out_dir / name).resolve():
                shutil.copyfile(tokenizer_dir / name, out_dir / name)
