"""Malformed checkpoints, fuzzed: whatever a config.json value, a safetensors header's or a GGUF file's header
bytes become, loading
gives either a model that runs or an error this project raises on purpose that names the file, never a
stray exception from deep inside torch, numpy or the gguf reader, and never an allocation of the sizes a
broken header claims."""

from __future__ import annotations

import json
import struct
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from gguf import GGUFReader
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onestream.worker.checkpoints import open_checkpoint
from onestream.worker.checkpoints.gguf_writer import write_gguf
from onestream.worker.errors import OnestreamError
from onestream.worker.loading import load_model
from onestream.worker.quant import QuantType
from onestream.worker.testing import write_tiny_checkpoint

TOKENS = torch.tensor([[1, 2, 3]])
FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
# What a hand edit or a bad conversion puts in a config.json value: every JSON kind, edges of each.
JSON_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**64), max_value=2**64),
    st.sampled_from([0, 1, 2, 3, 2**31, 2**62]),
    st.floats(),
    st.text(max_size=6),
    st.lists(st.integers(min_value=-2, max_value=400), max_size=3),
    st.dictionaries(st.sampled_from(["rope_type", "rope_theta", "partial_rotary_factor"]), st.integers(0, 3)),
)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("fuzz") / "tiny")


@pytest.fixture(scope="module")
def gguf_file(hf_dir: Path) -> Path:
    def q8_0_where_it_fits(name: str, shape: tuple[int, ...], block: int | None) -> QuantType:
        return QuantType.Q8_0 if len(shape) == 2 and shape[-1] % 32 == 0 else QuantType.F32

    return write_gguf(open_checkpoint(hf_dir), hf_dir.parent / "tiny.gguf", choose=q8_0_where_it_fits)


def loads_or_names(path: Path) -> None:
    """Load `path`: a model must run; an error must be one of ours and name the file."""
    try:
        model = load_model(path, dtype=torch.float32)
    except OnestreamError as e:
        assert str(path) in str(e), f"the error does not name {path}: {e}"
        return
    logits = model.forward(TOKENS)[0]
    assert logits.shape == (1, TOKENS.shape[1], model.config.vocab_size)


def config_keys(config: dict[str, Any], prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    keys = []
    for key, value in config.items():
        keys += config_keys(value, (*prefix, key)) if isinstance(value, dict) else [(*prefix, key)]
    return keys


@FUZZ
@given(data=st.data())
def test_any_config_value_loads_or_is_named(hf_dir: Path, data: st.DataObject) -> None:
    config = json.loads((hf_dir / "config.json").read_text())
    key = data.draw(st.sampled_from(config_keys(config)), label="key")
    value = data.draw(JSON_VALUES, label="value")
    holder = config
    for part in key[:-1]:
        holder = holder[part]
    holder[key[-1]] = value
    with tempfile.TemporaryDirectory() as scratch:
        edited = Path(scratch) / "edited"
        edited.mkdir()
        for file in hf_dir.iterdir():
            (edited / file.name).symlink_to(file)
        (edited / "config.json").unlink()
        (edited / "config.json").write_text(json.dumps(config))
        loads_or_names(edited)


def overwrite(original: bytes, end: int, data: st.DataObject) -> bytes:
    """`original` with up to 4 of its first `end` bytes overwritten: any byte, or one that keeps JSON
    looking like JSON (digits, quotes, brackets, signs)."""
    byte = st.one_of(st.integers(0, 255), st.sampled_from(b'0123456789"{}[],:-.eE '))
    edits = data.draw(
        st.lists(st.tuples(st.integers(0, end - 1), byte), min_size=1, max_size=4), label="edits"
    )
    corrupt = bytearray(original)
    for at, value in edits:
        corrupt[at] = value
    return bytes(corrupt)


@FUZZ
@given(data=st.data())
def test_any_safetensors_header_bytes_load_or_are_named(hf_dir: Path, data: st.DataObject) -> None:
    (weights,) = hf_dir.glob("*.safetensors")
    original = weights.read_bytes()
    header_end = 8 + struct.unpack("<Q", original[:8])[0]
    with tempfile.TemporaryDirectory() as scratch:
        edited = Path(scratch) / "edited"
        edited.mkdir()
        for file in hf_dir.iterdir():
            if file != weights:
                (edited / file.name).symlink_to(file)
        (edited / weights.name).write_bytes(overwrite(original, header_end, data))
        loads_or_names(edited)


@settings(FUZZ, max_examples=150)
@given(data=st.data())
def test_any_gguf_header_bytes_load_or_are_named(gguf_file: Path, data: st.DataObject) -> None:
    """Bytes of the header (metadata and tensor infos) overwritten; the tensor data, which a GGUF file
    carries no checksum of, is left as it is."""
    header_end = min(int(t.data_offset) for t in GGUFReader(gguf_file).tensors)
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "edited.gguf"
        path.write_bytes(overwrite(gguf_file.read_bytes(), header_end, data))
        loads_or_names(path)
