"""Long texts encoded a segment at a time (worker/segment_encoding.py): the same ids as encoding the whole text,
for the embedded model's tokenizer and a byte-level one, on random texts around added tokens and on
conversations growing turn by turn; a segment seen before is not encoded again; the memo stays within its size;
a tokenizer whose added tokens change their neighbours' encoding is encoded whole."""

from __future__ import annotations

import glob
from pathlib import Path

import pytest
import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st
from onestream.worker.segment_encoding import SegmentEncoder
from onestream.worker.testing import IM_END, IM_START, byte_level_tokenizer
from onestream.worker.tokenizer import SEGMENT_TEXT_CHARS, load_tokenizer

ROOT = Path(__file__).resolve().parents[1]
SCOPE = "user:alice"
EMBEDDED = load_tokenizer(ROOT / "worker" / "assets" / "default_model")
SPECIALS = [IM_START, IM_END, "<|endoftext|>"]
# Pieces that meet an added token's edges: spaces and newlines on either side, half a token, a token's prefix.
PIECES = st.sampled_from(
    [" ", "\n", "\n\n", "  ", "<|", "|>", "<|im", "im_start", "\t", "é", "🙂", "def f():\n"]
)
TEXTS = st.lists(
    st.one_of(st.sampled_from(SPECIALS), PIECES, st.text(max_size=40)), min_size=1, max_size=30
).map("".join)


def whole(backend: tokenizers.Tokenizer, text: str) -> list[int]:
    return backend.encode(text, add_special_tokens=False).ids


@settings(max_examples=300, deadline=None)
@given(text=TEXTS)
def test_segments_give_the_whole_texts_ids_embedded_tokenizer(text: str) -> None:
    encoder = SegmentEncoder(EMBEDDED.backend)
    assert encoder.usable
    assert encoder.encode(text, SCOPE) == whole(EMBEDDED.backend, text)
    assert encoder.encode(text, SCOPE) == whole(EMBEDDED.backend, text)  # again, from the memo


@settings(max_examples=200, deadline=None)
@given(text=TEXTS)
def test_segments_give_the_whole_texts_ids_byte_level_tokenizer(text: str) -> None:
    backend = byte_level_tokenizer()
    encoder = SegmentEncoder(backend)
    assert encoder.usable
    assert encoder.encode(text, SCOPE) == whole(backend, text)


def conversation(turns: int) -> list[dict[str, str]]:
    sources = sorted(glob.glob(str(ROOT / "cluster" / "*.py")))
    text = "".join(Path(f).read_text() for f in sources)
    messages = [{"role": "system", "content": text[:20000]}]
    for i in range(turns):
        start = 20000 + 3000 * i
        messages.append(
            {"role": "user" if i % 2 == 0 else "assistant", "content": text[start : start + 3000]}
        )
    return messages


class Recording:
    """The embedded tokenizer's backend, recording every text it is asked to encode."""

    def __init__(self) -> None:
        self.encoded: list[str] = []

    def __getattr__(self, name: str) -> object:
        return getattr(EMBEDDED.backend, name)

    def encode(self, text: str, add_special_tokens: bool = True) -> tokenizers.Encoding:
        self.encoded.append(text)
        return EMBEDDED.backend.encode(text, add_special_tokens=add_special_tokens)


def recording_encoder() -> tuple[SegmentEncoder, list[str]]:
    """A segment encoder of the embedded tokenizer, and the texts its backend encodes (the memo's misses)."""
    encoder = SegmentEncoder(EMBEDDED.backend)
    backend = Recording()
    encoder.backend = backend  # type: ignore[assignment]
    return encoder, backend.encoded


def test_a_growing_conversation_encodes_only_its_new_messages() -> None:
    encoder, encoded = recording_encoder()
    messages = conversation(6)
    for turn in range(1, len(messages) + 1):
        text = EMBEDDED.apply_chat_template(messages[:turn], add_generation_prompt=True)
        encoded.clear()
        assert encoder.encode(text, SCOPE) == whole(EMBEDDED.backend, text)
        if turn > 1:
            # the earlier messages came from the memo: what was encoded is about one message's length
            assert sum(map(len, encoded)) <= len(messages[turn - 1]["content"]) + 64


def test_the_tokenizer_encodes_a_requests_long_text_by_segment() -> None:
    text = EMBEDDED.apply_chat_template(conversation(3), add_generation_prompt=True)
    assert len(text) >= SEGMENT_TEXT_CHARS
    tokenizer = load_tokenizer(ROOT / "worker" / "assets" / "default_model")
    assert tokenizer.encode(text) == whole(tokenizer.backend, text)
    assert tokenizer._segments.remembered_chars == 0  # no scope: not a request's prompt, nothing remembered
    assert tokenizer.encode_at_most(text, 1 << 20, memo_scope=SCOPE) == whole(tokenizer.backend, text)
    assert tokenizer._segments.remembered_chars > 0
    short = "short " + IM_END
    assert tokenizer.encode(short, memo_scope=SCOPE) == whole(tokenizer.backend, short)


def test_scopes_do_not_share_what_they_remember() -> None:
    """How fast a prompt encodes must not tell one user what another sent (as with shared prefixes)."""
    encoder, encoded = recording_encoder()
    secret = f"{IM_START}system\nthe team's system prompt, word for word{IM_END}"
    encoder.encode(secret, "user:alice")
    encoded.clear()
    encoder.encode(secret, "user:bob")
    assert any("word for word" in text for text in encoded)  # bob's request encoded it afresh
    encoded.clear()
    encoder.encode(secret, "user:alice")
    assert encoded == []  # alice's own second turn did not


def test_the_memo_keeps_to_its_size() -> None:
    encoder = SegmentEncoder(EMBEDDED.backend, memo_chars=1000)
    for i in range(50):
        text = f"{IM_START}user\n{'x' * 97}{i:03d}{IM_END}"
        assert encoder.encode(text, SCOPE) == whole(EMBEDDED.backend, text)
    assert 0 < encoder.remembered_chars <= 1000


@pytest.mark.parametrize("flag", ["lstrip", "rstrip", "single_word", "normalized"])
def test_added_tokens_that_touch_their_neighbours_turn_the_memo_off(flag: str) -> None:
    backend = byte_level_tokenizer()
    backend.add_tokens([tokenizers.AddedToken("<tool>", **{flag: True})])
    encoder = SegmentEncoder(backend)
    assert not encoder.usable
    text = f"call  <tool>  now {IM_START} x"
    assert encoder.encode(text, SCOPE) == whole(backend, text)


def test_a_tokenizer_that_encodes_special_tokens_as_text_is_encoded_whole() -> None:
    backend = byte_level_tokenizer()
    backend.encode_special_tokens = True
    encoder = SegmentEncoder(backend)
    assert not encoder.usable
    text = f"{IM_START}user\nhi{IM_END}"
    assert encoder.encode(text, SCOPE) == whole(backend, text)
