"""Byte-level BPE for the embedded model, trained with the `tokenizers` library on the corpus' train split.

Pre-tokenisation is Qwen's: a regex split (digits one at a time, a leading space or punctuation glued to a
word, runs of newlines and indentation kept together) followed by the GPT-2 byte-to-unicode mapping, so
every byte sequence round-trips.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

END_OF_TEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (END_OF_TEXT, IM_START, IM_END)

# The split pattern Qwen2 / Qwen3 tokenizers use (contractions, words, single digits, punctuation runs,
# newlines with their leading whitespace, whitespace not followed by a non-space).
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# ChatML turns (what Qwen models use), with tools, tool calls and tool results in the Qwen3.5 XML form so
# that the HTTP front door's whole path runs on this model; it was trained on code only, so chat turns are
# plain text to it, but every prompt format the engine accepts has to render.
CHAT_TEMPLATE = (Path(__file__).parent / "chat_template.jinja").read_text(encoding="utf-8").rstrip("\n")


def build_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    return tok


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    tok = build_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def tokenizer_config() -> dict:
    """tokenizer_config.json: special tokens and the chat template, in the form transformers writes."""
    ids = {t: i for i, t in enumerate(SPECIAL_TOKENS)}  # the trainer puts special tokens first
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 262144,
        "bos_token": None,
        "eos_token": END_OF_TEXT,
        "pad_token": END_OF_TEXT,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": {
            str(i): {
                "content": t,
                "special": True,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "single_word": False,
            }
            for t, i in ids.items()
        },
        "additional_special_tokens": [IM_START, IM_END],
        "chat_template": CHAT_TEMPLATE,
    }


def save(tok: Tokenizer, out_dir: Path) -> None:
    for i, t in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(t) != i:
            raise RuntimeError(f"special token {t} has id {tok.token_to_id(t)}, expected {i}")
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2) + "\n")
