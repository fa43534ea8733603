"""The tokenizer: round trips, UTF-8-safe incremental decoding, chat templates, EOS ids, errors."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from onestream.worker.errors import CheckpointError, InvalidRequestError
from onestream.worker.testing import (
    CHATML_TEMPLATE,
    END_OF_TEXT,
    IM_END,
    IM_START,
    byte_level_tokenizer,
    special_token_id,
    tiny_config,
    write_tiny_checkpoint,
)
from onestream.worker.tokenizer import Tokenizer, load_tokenizer
from tokenizers import pre_tokenizers

RANGES = [(0x20, 0x7E), (0xA0, 0x17F), (0x391, 0x3C9), (0x4E00, 0x9FFF), (0x1F300, 0x1FAFF), (0xAC00, 0xD7A3)]

# A template in the style of Qwen's: system prompt handling, a namespace, a reversed scan, tojson,
# raise_exception and block tags on their own lines (trim_blocks / lstrip_blocks matter).
RICH_TEMPLATE = """
{% if tools is not none %}{{ raise_exception('no tools were given') }}{% endif %}
{% if messages[0].role == 'system' %}
    {{ '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{% endif %}
{% set ns = namespace(last_user=-1) %}
{% for message in messages[::-1] %}
    {% if ns.last_user == -1 and message.role == 'user' %}
        {% set ns.last_user = (messages|length - 1) - loop.index0 %}
    {% endif %}
{% endfor %}
{% for message in messages %}
    {% if message.role == 'system' and not loop.first %}
        {{ raise_exception('system message must come first') }}
    {% elif message.role != 'system' %}
        {{ '<|im_start|>' + message.role + '\\n' }}
        {% if loop.index0 == ns.last_user %}{{ {'last': true, 'text': 'ünï'} | tojson }}{% endif %}
        {{ message.content | trim + '<|im_end|>\\n' }}
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}
    {{ '<|im_start|>assistant\\n' }}
    {% if enable_thinking is defined and not enable_thinking %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}
{% endif %}
"""


@pytest.fixture
def rng() -> random.Random:
    seed = random.SystemRandom().randrange(2**31)
    print(f"seed {seed}")
    return random.Random(seed)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"))


@pytest.fixture(scope="module")
def tokenizer(checkpoint: Path) -> Tokenizer:
    return load_tokenizer(checkpoint)


def random_text(rng: random.Random, length: int) -> str:
    chars = []
    for _ in range(length):
        lo, hi = rng.choice(RANGES)
        chars.append(chr(rng.randint(lo, hi)))
    return "".join(chars)


def _write_json(path: Path, value: object) -> None:
    path.write_text(json.dumps(value))


def _edit_json(path: Path, **changes: object) -> None:
    raw = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            raw.pop(key, None)
        else:
            raw[key] = value
    _write_json(path, raw)


# ---- the fixture tokenizer ----------------------------------------------------------------------


def test_byte_level_tokenizer_has_bytes_merges_and_special_tokens() -> None:
    tok = byte_level_tokenizer()
    vocab = tok.get_vocab(with_added_tokens=True)
    assert set(pre_tokenizers.ByteLevel.alphabet()) <= set(vocab)
    size = tok.get_vocab_size(with_added_tokens=True)
    assert size > 256 + 3 + 50  # some merges were learnt
    assert [tok.token_to_id(t) for t in (END_OF_TEXT, IM_START, IM_END)] == [size - 3, size - 2, size - 1]
    assert byte_level_tokenizer().to_str() == tok.to_str()  # deterministic
    config = tiny_config()
    assert config.vocab_size % 64 == 0 and size <= config.vocab_size < size + 64
    assert config.layer_types.count("linear_attention") == 3 and config.has_mtp


# ---- round trips --------------------------------------------------------------------------------


def test_round_trip_ascii_and_multibyte(tokenizer: Tokenizer, rng: random.Random) -> None:
    for _ in range(50):
        text = random_text(rng, rng.randint(1, 40))
        ids = tokenizer.encode(text)
        assert all(0 <= i < tokenizer.vocab_size for i in ids)
        assert tokenizer.decode(ids) == text
    assert tokenizer.encode("def main():") != []
    assert len(tokenizer.encode("the ")) < len("the ")  # merges apply


def test_special_tokens_are_single_ids(tokenizer: Tokenizer) -> None:
    im_start, im_end = special_token_id(IM_START), special_token_id(IM_END)
    ids = tokenizer.encode(f"{IM_START}user\nhi{IM_END}")
    assert ids[0] == im_start and ids[-1] == im_end
    assert tokenizer.decode(ids, skip_special_tokens=True) == "user\nhi"
    assert tokenizer.decode(ids) == f"{IM_START}user\nhi{IM_END}"
    with pytest.raises(InvalidRequestError, match="must be a string"):
        tokenizer.encode(["not", "text"])  # type: ignore[arg-type]


# ---- incremental decoding -----------------------------------------------------------------------


def test_incremental_decoder_holds_back_partial_characters(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("😀")
    assert len(ids) == 4  # one byte token each
    decoder = tokenizer.incremental_decoder()
    assert [decoder.push(i) for i in ids] == ["", "", "", "😀"]
    cjk = tokenizer.encode("a世")
    decoder = tokenizer.incremental_decoder()
    assert [decoder.push(i) for i in cjk] == ["a", "", "", "世"]
    assert decoder.flush() == ""


def test_incremental_decoder_equals_decode_in_random_chunks(tokenizer: Tokenizer, rng: random.Random) -> None:
    for _ in range(30):
        text = random_text(rng, rng.randint(1, 60))
        ids = tokenizer.encode(text)
        decoder = tokenizer.incremental_decoder()
        deltas = []
        pos = 0
        while pos < len(ids):
            step = rng.randint(1, 3)
            deltas.append(decoder.push(ids[pos : pos + step]))
            pos += step
            # Everything complete so far is out at once; only a trailing partial character waits.
            assert "".join(deltas) == tokenizer.decode(ids[:pos]).removesuffix("\ufffd")
        deltas.append(decoder.flush())
        assert "".join(deltas) == text
        assert not any("\ufffd" in d for d in deltas)


def test_incremental_decoder_skips_special_tokens(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(f"é{IM_END}x")
    decoder = tokenizer.incremental_decoder(skip_special_tokens=True)
    assert "".join(decoder.push(i) for i in ids) + decoder.flush() == "éx"


def test_incremental_decoder_emits_invalid_bytes_eventually(tokenizer: Tokenizer) -> None:
    continuation = tokenizer.encode("😀")[1:]  # bytes that can never start a character
    ids = continuation * 4 + tokenizer.encode("ok")
    decoder = tokenizer.incremental_decoder()
    before_flush = "".join(decoder.push(i) for i in ids)
    assert before_flush.endswith("ok")  # not held back forever
    assert before_flush + decoder.flush() == tokenizer.decode(ids)
    decoder = tokenizer.incremental_decoder()
    assert decoder.push(tokenizer.encode("😀")[:2]) == ""
    assert decoder.flush() == tokenizer.decode(tokenizer.encode("😀")[:2])  # replacement characters
    assert decoder.push(tokenizer.encode("z")) == "z"  # reset after flush


# ---- chat templates -----------------------------------------------------------------------------


def test_chatml_template(tokenizer: Tokenizer) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "héllo 😀"}]
    assert tokenizer.apply_chat_template(messages) == (
        "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhéllo 😀<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=False).endswith("😀<|im_end|>\n")
    prompt_ids = tokenizer.encode(tokenizer.apply_chat_template(messages))
    assert prompt_ids.count(special_token_id(IM_START)) == 3


def test_rich_template_matches_transformers(tmp_path: Path, rng: random.Random) -> None:
    transformers = pytest.importorskip("transformers")
    directory = write_tiny_checkpoint(tmp_path)
    _edit_json(directory / "tokenizer_config.json", chat_template=RICH_TEMPLATE)
    ours = load_tokenizer(directory)
    theirs = transformers.AutoTokenizer.from_pretrained(directory)
    for _ in range(5):
        messages = [{"role": "system", "content": random_text(rng, 8)}]
        for turn in range(rng.randint(1, 3)):
            messages.append({"role": "user", "content": f" {random_text(rng, 10)}\n"})
            if turn % 2 == 0:
                messages.append({"role": "assistant", "content": random_text(rng, 10)})
        for thinking in (True, False):
            want = theirs.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True, enable_thinking=thinking
            )
            assert ours.apply_chat_template(messages, enable_thinking=thinking) == want


def test_template_exceptions_become_request_errors(tmp_path: Path) -> None:
    directory = write_tiny_checkpoint(tmp_path)
    _edit_json(directory / "tokenizer_config.json", chat_template=RICH_TEMPLATE)
    tok = load_tokenizer(directory)
    messages = [{"role": "user", "content": "a"}, {"role": "system", "content": "late"}]
    with pytest.raises(InvalidRequestError, match="system message must come first"):
        tok.apply_chat_template(messages)


def test_template_is_sandboxed(tmp_path: Path) -> None:
    directory = write_tiny_checkpoint(tmp_path)
    escape = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    _edit_json(directory / "tokenizer_config.json", chat_template=escape)
    with pytest.raises(InvalidRequestError, match="chat template rejected"):
        load_tokenizer(directory).apply_chat_template([{"role": "user", "content": "x"}])


def test_named_templates_and_template_file(tmp_path: Path) -> None:
    directory = write_tiny_checkpoint(tmp_path)
    named = [{"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": CHATML_TEMPLATE}]
    _edit_json(directory / "tokenizer_config.json", chat_template=named)
    messages = [{"role": "user", "content": "q"}]
    tok = load_tokenizer(directory)
    assert tok.apply_chat_template(messages).startswith("<|im_start|>user")
    assert tok.apply_chat_template(messages, template_name="tool_use") == "TOOLS"
    with pytest.raises(InvalidRequestError, match="chat template 'nope' does not exist"):
        tok.apply_chat_template(messages, template_name="nope")
    (directory / "chat_template.jinja").write_text("FILE {{ messages[0].content }}")
    assert load_tokenizer(directory).apply_chat_template(messages) == "FILE q"


def test_template_errors(tmp_path: Path) -> None:
    directory = write_tiny_checkpoint(tmp_path)
    _edit_json(directory / "tokenizer_config.json", chat_template=None)
    with pytest.raises(InvalidRequestError, match="no chat template"):
        load_tokenizer(directory).apply_chat_template([{"role": "user", "content": "q"}])
    _edit_json(directory / "tokenizer_config.json", chat_template="{% for m in messages %}")
    with pytest.raises(CheckpointError, match="not valid jinja2"):
        load_tokenizer(directory).apply_chat_template([{"role": "user", "content": "q"}])
    _edit_json(directory / "tokenizer_config.json", chat_template=[{"name": "x"}])
    with pytest.raises(CheckpointError, match=r"chat_template\[0\]"):
        load_tokenizer(directory)


@pytest.mark.parametrize(
    ("messages", "message"),
    [
        ("hello", "messages must be a non-empty list"),
        ([], "messages must be a non-empty list"),
        (["hello"], r"messages\[0\] must be an object"),
        ([{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}], r"messages\[1\]\.role"),
        ([{"role": "user", "content": "a"}, {"content": "b"}], r"messages\[1\]\.role"),
        ([{"role": "user", "content": 5}], r"messages\[0\]\.content must be a string, got int"),
        ([{"role": "user"}], r"messages\[0\]\.content must be a string, got NoneType"),
    ],
)
def test_bad_messages_name_the_index(tokenizer: Tokenizer, messages: object, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        tokenizer.apply_chat_template(messages)  # type: ignore[arg-type]


# ---- EOS ids and special tokens -----------------------------------------------------------------


def test_eos_from_generation_config(tokenizer: Tokenizer) -> None:
    assert tokenizer.eos_token_ids == (special_token_id(IM_END), special_token_id(END_OF_TEXT))
    assert (
        tokenizer.eos_token == IM_END and tokenizer.pad_token == END_OF_TEXT and tokenizer.bos_token is None
    )
    assert tokenizer.pad_token_id == special_token_id(END_OF_TEXT)


def test_eos_resolution_order(tmp_path: Path) -> None:
    eot, im_end = special_token_id(END_OF_TEXT), special_token_id(IM_END)
    flat = write_tiny_checkpoint(tmp_path / "flat")
    _write_json(flat / "generation_config.json", {"eos_token_id": 7})
    assert load_tokenizer(flat).eos_token_ids == (7,)
    (flat / "generation_config.json").unlink()
    assert load_tokenizer(flat).eos_token_ids == (eot,)  # config.json
    _edit_json(flat / "config.json", eos_token_id=None)
    assert load_tokenizer(flat).eos_token_ids == (im_end,)  # tokenizer_config's eos_token
    _edit_json(flat / "tokenizer_config.json", eos_token=None)
    assert load_tokenizer(flat).eos_token_ids == ()

    nested = write_tiny_checkpoint(tmp_path / "nested", multimodal_names=True)
    _write_json(nested / "generation_config.json", {"pad_token_id": 0})
    assert load_tokenizer(nested).eos_token_ids == (eot,)  # text_config's eos_token_id
    _write_json(nested / "generation_config.json", {"eos_token_id": [1, "x"]})
    with pytest.raises(CheckpointError, match=r"generation_config\.json: eos_token_id must be an integer"):
        load_tokenizer(nested)


def test_special_tokens_as_added_token_objects(tmp_path: Path) -> None:
    directory = write_tiny_checkpoint(tmp_path)
    _edit_json(directory / "tokenizer_config.json", eos_token={"content": IM_END, "special": True})
    (directory / "generation_config.json").unlink()
    _edit_json(directory / "config.json", eos_token_id=None)
    assert load_tokenizer(directory).eos_token_ids == (special_token_id(IM_END),)
    _edit_json(directory / "tokenizer_config.json", eos_token="<|missing|>")
    with pytest.raises(CheckpointError, match=r"eos_token '<\|missing\|>' is not in tokenizer\.json"):
        load_tokenizer(directory)


# ---- bad files ----------------------------------------------------------------------------------


def test_bad_tokenizer_files(tmp_path: Path) -> None:
    directory = write_tiny_checkpoint(tmp_path)
    (directory / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"tokenizer_config\.json: not valid JSON"):
        load_tokenizer(directory)
    (directory / "tokenizer.json").write_text('{"version": "1.0"}')
    with pytest.raises(CheckpointError, match=r"tokenizer\.json: cannot be read"):
        load_tokenizer(directory)
    (directory / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match=r"no tokenizer\.json"):
        load_tokenizer(directory)
