"""Test fixtures shared by every part: a tiny byte-level tokenizer and tiny random checkpoints.

The checkpoints are complete Hugging Face directories (config, safetensors, tokenizer, chat
template, generation config) whose random weights give peaked next-token distributions, so
numerical comparisons against them are meaningful.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from .checkpoints.hf import INDEX_FILE, SINGLE_FILE
from .config import ModelConfig
from .loading import expected_tensor_shapes

END_OF_TEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (END_OF_TEXT, IM_START, IM_END)

CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# A few lines to learn some merges from; multi-byte characters stay split into byte tokens.
_TRAINING_TEXT = (
    "def main():\n    print('hello world')\n    return 0\n",
    "The quick brown fox jumps over the lazy dog. The dog sleeps.",
    "for i in range(10):\n    if i % 2 == 0:\n        continue\n",
    "import torch\nimport numpy as np\nclass Model:\n    def __init__(self):\n        self.x = None\n",
    "the engine streams tokens; the router sends requests to the cards.",
)
_MERGES = 120


@functools.lru_cache(maxsize=1)
def _byte_level_tokenizer_json() -> str:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=len(alphabet) + _MERGES, initial_alphabet=alphabet, show_progress=False
    )
    tok.train_from_iterator(_TRAINING_TEXT, trainer)
    tok.add_special_tokens(list(SPECIAL_TOKENS))  # after the merges, as in Qwen's vocabulary
    return tok.to_str()


def byte_level_tokenizer() -> Tokenizer:
    """A fresh byte-level BPE: 256 byte tokens, some merges, then the three special tokens."""
    return Tokenizer.from_str(_byte_level_tokenizer_json())


def special_token_id(token: str) -> int:
    token_id = byte_level_tokenizer().token_to_id(token)
    assert token_id is not None, token
    return token_id


def tiny_config(**overrides: object) -> ModelConfig:
    """A 4-layer (3 DeltaNet + 1 full attention) model with an MTP head, hidden size 64."""
    vocab = byte_level_tokenizer().get_vocab_size(with_added_tokens=True)
    fields: dict[str, object] = {
        "vocab_size": math.ceil(vocab / 64) * 64,
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "intermediate_size": 128,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 32,
        "linear_value_head_dim": 32,
        "mtp_num_hidden_layers": 1,
        "max_position_embeddings": 4096,
        "eos_token_ids": (special_token_id(END_OF_TEXT),),
        "pad_token_id": special_token_id(END_OF_TEXT),
    }
    fields.update(overrides)
    return ModelConfig(**fields)  # type: ignore[arg-type]


def random_weights(config: ModelConfig, *, seed: int = 0, peaked: bool = True) -> dict[str, torch.Tensor]:
    """fp32 random weights for every tensor of `config`, scaled like a trained model.

    `peaked=True` scales embeddings and lm_head so that next-token distributions are sharp
    (logits with a standard deviation around 5); otherwise they are near uniform.
    """
    generator = torch.Generator().manual_seed(seed)
    logit_scale = 5.0 if peaked else 0.2
    weights = {}
    for name, shape in expected_tensor_shapes(config).items():
        weights[name] = _init_tensor(name, shape, generator, logit_scale / math.sqrt(config.hidden_size))
    return weights


def _init_tensor(
    name: str, shape: tuple[int, ...], generator: torch.Generator, embed_std: float
) -> torch.Tensor:
    def normal(std: float) -> torch.Tensor:
        return torch.randn(shape, generator=generator) * std

    if name.endswith(("embed_tokens.weight", "lm_head.weight")):
        return normal(embed_std)
    if name.endswith("linear_attn.norm.weight"):  # a plain weight, ones at init
        return 1.0 + normal(0.1)
    if "norm" in name.rsplit(".", 2)[-2]:  # zero-centred (1 + w) norms, including mtp.pre_fc_norm_*
        return normal(0.1)
    if name.endswith(".A_log"):
        return torch.empty(shape).uniform_(1.0, 16.0, generator=generator).log_()
    if name.endswith(".dt_bias"):
        return normal(0.1)
    if name.endswith("conv1d.weight"):
        return normal(1.0 / math.sqrt(shape[-1]))
    return normal(1.0 / math.sqrt(shape[1]))


def write_tiny_checkpoint(
    directory: str | Path,
    *,
    config: ModelConfig | None = None,
    seed: int = 0,
    peaked: bool = True,
    shards: int = 1,
    multimodal_names: bool = False,
    dtype: torch.dtype = torch.float32,
    with_mtp: bool = True,
    weights: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write a complete checkpoint directory with random weights; returns the directory.

    One shard is written as `model.safetensors` (no index); more as `model-0000i-of-0000n`
    files with `model.safetensors.index.json`. `multimodal_names` stores text tensors as
    `model.language_model.*`, adds a `model.visual.*` tensor and nests the config under
    `text_config`. `with_mtp=False` writes neither MTP tensors nor an MTP head in the config. `weights`
    replaces `random_weights(config, seed, peaked)` (names and shapes as `expected_tensor_shapes(config)`).
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = config or tiny_config()
    if not with_mtp and config.has_mtp:
        config = dataclasses.replace(config, mtp_num_hidden_layers=0)
    tokenizer = byte_level_tokenizer()
    if config.vocab_size < tokenizer.get_vocab_size(with_added_tokens=True):
        raise ValueError(f"vocab_size {config.vocab_size} is smaller than the tokenizer's vocabulary")

    if weights is None:
        weights = random_weights(config, seed=seed, peaked=peaked)
    elif not config.has_mtp:
        weights = {n: t for n, t in weights.items() if not n.startswith("mtp.")}
    tensors = {name: t.to(dtype) for name, t in weights.items()}
    if multimodal_names:
        tensors = {_multimodal_name(n): t for n, t in tensors.items()}
        tensors["model.visual.patch_embed.proj.weight"] = torch.randn(8, 3, 2, 2, 2).to(dtype)
    _write_shards(directory, tensors, shards)
    _write_json(directory / "config.json", _config_json(config, multimodal_names))
    _write_tokenizer_files(directory, tokenizer, config)
    return directory


# A random model conditioned like a trained one, for measurements that should reflect the code under test rather
# than the model: `random_weights` (every matrix N(0, 1/fan_in), embeddings small, logits of std 5) makes the first
# layer's update several times the residual stream and the logits large, so the megakernel's bf16 roundings of
# activations cost ~100x the KLD they cost a trained model (docs/benchmarks.md, issue 21's conditioned model).
CONDITIONED_EMBED_STD = 1.0  # residual stream of rms ~1 from the first layer on
CONDITIONED_UPDATE = 0.3  # output projections (o_proj, out_proj, down_proj): each update ~0.3 of the stream
CONDITIONED_NORM_STD = 0.05  # zero-centred norm weights: (1 + w) within a few % of 1
CONDITIONED_LOGIT_STD = 2.5  # lm_head's random part: logits of std ~2.5 (the embedded model's: 3.0)
CONDITIONED_BIGRAM = (
    0.6  # norm of each lm_head row's part along a random predecessor's embedding (peaked rows)
)
_OUTPUT_PROJECTIONS = ("o_proj.weight", "out_proj.weight", "down_proj.weight")


def conditioned_config(**overrides: object) -> ModelConfig:
    """8 layers (6 DeltaNet, 2 full attention) of hidden 512 with every GEMV row (the input dimension) a multiple
    of 256, so that each K-quant type keeps its own 256-blocks (no 32-block fallbacks); an 8,192-token vocabulary
    (the embedded model's, so its held-out token file serves), untied lm_head, an MTP head."""
    fields: dict[str, object] = {
        "vocab_size": 8192,
        "hidden_size": 512,
        "num_hidden_layers": 8,
        "layer_types": (),
        "intermediate_size": 1024,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 128,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "max_position_embeddings": 8192,
    }
    fields.update(overrides)
    return tiny_config(**fields)


def conditioned_weights(config: ModelConfig, *, seed: int = 0) -> dict[str, torch.Tensor]:
    """fp32 random weights conditioned like a trained model's (see CONDITIONED_*): a residual stream that each
    layer changes by a modest fraction, norms near 1, and next-token distributions about as peaked as a trained
    small model's (mean top probability 0.4-0.5) without its huge logits. The peaks come from a random bigram table:
    row j of lm_head leans towards the embedding of token perm[j], which the residual stream carries."""
    if config.tie_word_embeddings:
        raise ValueError("conditioned_weights needs an untied lm_head")
    weights = random_weights(config, seed=seed)
    generator = torch.Generator().manual_seed(seed + 1)
    hidden = config.hidden_size
    for name, w in weights.items():
        if name.endswith(_OUTPUT_PROJECTIONS):
            weights[name] = w * CONDITIONED_UPDATE
        elif "norm" in name.rsplit(".", 2)[-2] and not name.endswith("linear_attn.norm.weight"):
            weights[name] = w * (
                CONDITIONED_NORM_STD / 0.1
            )  # random_weights' zero-centred norms are N(0, 0.1)
    embed = torch.randn(config.vocab_size, hidden, generator=generator) * CONDITIONED_EMBED_STD
    weights["model.embed_tokens.weight"] = embed
    predecessor = embed[torch.randperm(config.vocab_size, generator=generator)]
    weights["lm_head.weight"] = CONDITIONED_BIGRAM * predecessor / predecessor.norm(dim=-1, keepdim=True) + (
        torch.randn(config.vocab_size, hidden, generator=generator)
        * (CONDITIONED_LOGIT_STD / math.sqrt(hidden))
    )
    return weights


def write_conditioned_checkpoint(
    directory: str | Path,
    *,
    config: ModelConfig | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """A checkpoint directory (as `write_tiny_checkpoint`) of `conditioned_weights` for `config`
    (default `conditioned_config()`); returns the directory."""
    config = config or conditioned_config()
    return write_tiny_checkpoint(
        directory, config=config, seed=seed, dtype=dtype, weights=conditioned_weights(config, seed=seed)
    )


def _multimodal_name(name: str) -> str:
    return "model.language_model." + name[len("model.") :] if name.startswith("model.") else name


def _config_json(config: ModelConfig, multimodal: bool) -> dict[str, object]:
    text = config.to_hf_text_dict()
    if not multimodal:
        return text
    text.pop("architectures")
    return {
        "model_type": "qwen3_5",
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "text_config": text,
        "vision_config": {"model_type": "qwen3_5", "depth": 1, "hidden_size": 8},
        "tie_word_embeddings": config.tie_word_embeddings,
    }


def _write_shards(directory: Path, tensors: dict[str, torch.Tensor], shards: int) -> None:
    if not 1 <= shards <= len(tensors):
        raise ValueError(f"shards must be between 1 and the number of tensors ({len(tensors)})")
    if shards == 1:
        save_file(tensors, str(directory / SINGLE_FILE), metadata={"format": "pt"})
        return
    names = list(tensors)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    groups: list[list[str]] = [[] for _ in range(shards)]
    running = 0
    for name in names:  # contiguous groups of about equal bytes, never empty
        size = tensors[name].numel() * tensors[name].element_size()
        shard = min(shards - 1, running * shards // max(total, 1))
        groups[shard].append(name)
        running += size
    for group in groups:
        if not group:  # fewer tensors than bytes suggest: take one from the fullest shard
            donor = max(groups, key=len)
            group.append(donor.pop())
    weight_map = {}
    for shard, group in enumerate(groups):
        file_name = f"model-{shard + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensors[n] for n in group}, str(directory / file_name), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(group, file_name)
    _write_json(directory / INDEX_FILE, {"metadata": {"total_size": total}, "weight_map": weight_map})


def _write_tokenizer_files(directory: Path, tokenizer: Tokenizer, config: ModelConfig) -> None:
    tokenizer.save(str(directory / "tokenizer.json"))
    ids = {token: tokenizer.token_to_id(token) for token in SPECIAL_TOKENS}
    _write_json(
        directory / "tokenizer_config.json",
        {
            "tokenizer_class": "Qwen2Tokenizer",
            "chat_template": CHATML_TEMPLATE,
            "eos_token": IM_END,
            "pad_token": END_OF_TEXT,
            "bos_token": None,
            "added_tokens_decoder": {
                str(token_id): {"content": token, "special": True} for token, token_id in ids.items()
            },
        },
    )
    _write_json(
        directory / "generation_config.json",
        {"eos_token_id": [ids[IM_END], ids[END_OF_TEXT]], "pad_token_id": config.pad_token_id},
    )


def _write_json(path: Path, value: object) -> None:
    path.write_text(json.dumps(value, indent=2) + "\n")
