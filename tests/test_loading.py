"""Checkpoint loading: every layout the loader accepts, every error it names, and its peak memory."""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from onestream.worker.checkpoints import hf, open_checkpoint
from onestream.worker.checkpoints.hf import INDEX_FILE, SINGLE_FILE, checkpoint_files, read_checkpoint_tensors
from onestream.worker.config import ModelConfig
from onestream.worker.errors import CheckpointError, UnsupportedModelError
from onestream.worker.loading import default_model_dir, expected_tensor_shapes, load_model, load_weights_into
from onestream.worker.model import Qwen35ForCausalLM
from onestream.worker.testing import random_weights, tiny_config, write_tiny_checkpoint
from safetensors.torch import load_file, save_file

torch.set_num_threads(2)

CONFIGS = {
    "untied": {},
    "tied": {"tie_word_embeddings": True},
    "no_mtp": {"mtp_num_hidden_layers": 0},
    "hv_eq_hk_two_full": {
        "linear_num_value_heads": 2,
        "num_hidden_layers": 5,
        "layer_types": (
            "full_attention",
            "linear_attention",
            "full_attention",
            "linear_attention",
            "linear_attention",
        ),
    },
}


def _seed() -> int:
    return random.SystemRandom().randrange(2**31)


def _stored(directory: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for path in checkpoint_files(directory):
        tensors |= load_file(str(path))
    return tensors


def _rewrite_single_shard(directory: Path, tensors: dict[str, torch.Tensor]) -> None:
    save_file(tensors, str(directory / SINGLE_FILE))


# ---- names and shapes ---------------------------------------------------------------------------


@pytest.mark.parametrize("overrides", CONFIGS.values(), ids=CONFIGS.keys())
def test_expected_shapes_equal_model_state_dict(overrides: dict) -> None:
    config = tiny_config(**overrides)
    model = Qwen35ForCausalLM(config)
    assert {k: tuple(v.shape) for k, v in model.state_dict().items()} == expected_tensor_shapes(config)


@pytest.mark.parametrize("overrides", CONFIGS.values(), ids=CONFIGS.keys())
def test_expected_shapes_equal_transformers_text_model(overrides: dict) -> None:
    transformers = pytest.importorskip("transformers")
    config = tiny_config(**overrides)
    hf_config = transformers.Qwen3_5TextConfig(**config.to_hf_text_dict())
    with torch.device("meta"):
        hf_model = transformers.Qwen3_5ForCausalLM(hf_config)
    hf_shapes = {k: tuple(v.shape) for k, v in hf_model.state_dict().items()}
    if config.tie_word_embeddings:
        hf_shapes.pop("lm_head.weight", None)  # the same tensor as the embedding
    ours = {k: v for k, v in expected_tensor_shapes(config).items() if not k.startswith("mtp.")}
    assert hf_shapes == ours


def test_expected_shapes_follow_the_config() -> None:
    config = tiny_config(
        hidden_size=96, linear_num_key_heads=3, linear_num_value_heads=6, linear_key_head_dim=16
    )
    shapes = expected_tensor_shapes(config)
    c = 2 * 3 * 16 + 6 * 32
    assert shapes["model.layers.0.linear_attn.in_proj_qkv.weight"] == (c, 96)
    assert shapes["model.layers.0.linear_attn.conv1d.weight"] == (c, 1, 4)
    assert shapes["model.layers.0.linear_attn.A_log"] == (6,)
    assert shapes["model.layers.0.linear_attn.norm.weight"] == (32,)
    assert shapes["model.layers.3.self_attn.q_proj.weight"] == (2 * 4 * 32, 96)
    assert shapes["model.layers.3.self_attn.k_norm.weight"] == (32,)
    assert shapes["mtp.fc.weight"] == (96, 192)
    assert shapes["mtp.layers.0.self_attn.o_proj.weight"] == (96, 128)


# ---- the layouts the loader reads ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("shards", "multimodal", "overrides"),
    [
        (1, False, {}),
        (3, False, {}),
        (1, True, {}),
        (4, True, {"tie_word_embeddings": True}),
        (2, False, {"tie_word_embeddings": True}),
    ],
    ids=["single", "sharded", "multimodal", "multimodal_sharded_tied", "sharded_tied"],
)
def test_read_checkpoint_tensors_gives_the_written_weights(
    tmp_path: Path, shards: int, multimodal: bool, overrides: dict
) -> None:
    seed = _seed()
    config = tiny_config(**overrides)
    write_tiny_checkpoint(tmp_path, config=config, seed=seed, shards=shards, multimodal_names=multimodal)
    if shards > 1:
        assert len(checkpoint_files(tmp_path)) == shards and (tmp_path / INDEX_FILE).is_file()
    if multimodal:
        stored = _stored(tmp_path)
        assert "model.visual.patch_embed.proj.weight" in stored
        assert all(not n.startswith("model.layers.") for n in stored)
    read = dict(read_checkpoint_tensors(tmp_path, ModelConfig.from_dir(tmp_path)))
    expected = random_weights(config, seed=seed)
    assert read.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(read[name], tensor), name


def test_load_model_gives_the_logits_of_the_source_model(tmp_path: Path) -> None:
    seed = _seed()
    config = tiny_config()
    source = Qwen35ForCausalLM(config)
    source.load_state_dict(random_weights(config, seed=seed))
    write_tiny_checkpoint(tmp_path, config=config, seed=seed, shards=2, multimodal_names=True)
    loaded = load_model(tmp_path, dtype=torch.float32)
    ids = torch.randint(0, config.vocab_size, (2, 23))
    with torch.no_grad():
        logits, hidden = source(ids)
        loaded_logits, loaded_hidden = loaded(ids)
        mtp_logits, _ = source.mtp_forward(ids, hidden)
        loaded_mtp_logits, _ = loaded.mtp_forward(ids, loaded_hidden)
    assert torch.equal(logits, loaded_logits)
    assert torch.equal(mtp_logits, loaded_mtp_logits)
    assert logits.softmax(-1).amax(-1).mean() > 0.2  # peaked, so the comparison means something
    assert not any(p.requires_grad for p in loaded.parameters())


@pytest.mark.parametrize("stored_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("load_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_load_model_casts_but_keeps_decay_parameters_fp32(
    tmp_path: Path, stored_dtype: torch.dtype, load_dtype: torch.dtype
) -> None:
    seed = _seed()
    config = tiny_config(tie_word_embeddings=True)
    write_tiny_checkpoint(tmp_path, config=config, seed=seed, dtype=stored_dtype)
    assert _stored(tmp_path)["model.layers.0.linear_attn.A_log"].dtype == stored_dtype
    model = load_model(tmp_path, dtype=load_dtype)
    expected = random_weights(config, seed=seed)
    for name, param in model.named_parameters():
        want = torch.float32 if name.endswith(("A_log", "dt_bias")) else load_dtype
        assert param.dtype == want, name
        assert torch.equal(param, expected[name].to(stored_dtype).to(want)), name
    assert model.lm_head_weight is model.model.embed_tokens.weight


def test_checkpoint_without_mtp_tensors_loads_without_the_head(tmp_path: Path) -> None:
    write_tiny_checkpoint(tmp_path)
    tensors = {n: t for n, t in _stored(tmp_path).items() if not n.startswith("mtp.")}
    _rewrite_single_shard(tmp_path, tensors)  # as transformers' save_pretrained writes it
    model = load_model(tmp_path, dtype=torch.float32)
    assert not model.config.has_mtp
    assert not any(n.startswith("mtp.") for n, _ in model.named_parameters())


def test_mtp_tensors_are_ignored_when_the_config_has_no_head(tmp_path: Path) -> None:
    write_tiny_checkpoint(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["mtp_num_hidden_layers"] = 0
    (tmp_path / "config.json").write_text(json.dumps(raw))
    names = dict(read_checkpoint_tensors(tmp_path, ModelConfig.from_dir(tmp_path)))
    assert not any(n.startswith("mtp.") for n in names)


def test_tied_checkpoint_may_store_lm_head(tmp_path: Path) -> None:
    config = tiny_config(tie_word_embeddings=True)
    write_tiny_checkpoint(tmp_path, config=config)
    tensors = _stored(tmp_path)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    _rewrite_single_shard(tmp_path, tensors)
    model = load_model(tmp_path, dtype=torch.float32)
    assert torch.equal(model.lm_head_weight, tensors["model.embed_tokens.weight"])


def test_load_weights_into_an_existing_model(tmp_path: Path) -> None:
    seed = _seed()
    config = tiny_config()
    write_tiny_checkpoint(tmp_path, config=config, seed=seed, shards=2)
    model = Qwen35ForCausalLM(config).to(torch.bfloat16)
    load_weights_into(model, tmp_path)
    expected = random_weights(config, seed=seed)
    for name, param in model.named_parameters():
        assert torch.equal(param.detach(), expected[name].to(param.dtype)), name

    other = Qwen35ForCausalLM(tiny_config(mtp_num_hidden_layers=0))
    with pytest.raises(CheckpointError, match=r"model's parameters do not match.*mtp\.fc\.weight"):
        load_weights_into(other, tmp_path, config=config)


def test_load_a_sharded_transformers_save_pretrained_checkpoint(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    config = tiny_config(mtp_num_hidden_layers=0)
    torch.manual_seed(_seed())
    hf_model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**config.to_hf_text_dict()))
    hf_model.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / INDEX_FILE).is_file() and len(checkpoint_files(tmp_path)) > 2
    model = load_model(tmp_path, dtype=torch.float32)
    hf_state = hf_model.state_dict()
    for name, param in model.named_parameters():
        assert torch.equal(param, hf_state[name]), name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_load_model_onto_cuda(tmp_path: Path) -> None:
    write_tiny_checkpoint(tmp_path, dtype=torch.bfloat16)
    on_cpu = load_model(tmp_path, dtype=torch.bfloat16)
    on_gpu = load_model(tmp_path, dtype=torch.bfloat16, device="cuda")
    for (name, a), (_, b) in zip(on_cpu.named_parameters(), on_gpu.named_parameters(), strict=True):
        assert b.device.type == "cuda" and b.dtype == a.dtype and torch.equal(a, b.cpu()), name


# ---- errors -------------------------------------------------------------------------------------


def test_missing_tensor_is_named(tmp_path: Path) -> None:
    write_tiny_checkpoint(tmp_path)
    tensors = _stored(tmp_path)
    del tensors["model.layers.2.linear_attn.dt_bias"]
    _rewrite_single_shard(tmp_path, tensors)
    with pytest.raises(CheckpointError, match=r"missing tensors 'model\.layers\.2\.linear_attn\.dt_bias'"):
        load_model(tmp_path)


def test_partial_mtp_head_is_missing_tensors(tmp_path: Path) -> None:
    write_tiny_checkpoint(tmp_path)
    tensors = _stored(tmp_path)
    del tensors["mtp.fc.weight"]
    _rewrite_single_shard(tmp_path, tensors)
    with pytest.raises(CheckpointError, match=r"missing tensors 'mtp\.fc\.weight'"):
        load_model(tmp_path)


def test_unexpected_tensor_is_named(tmp_path: Path) -> None:
    write_tiny_checkpoint(tmp_path, multimodal_names=True)
    tensors = _stored(tmp_path)
    tensors["model.language_model.layers.1.self_attn.q_proj.weight"] = torch.zeros(4, 4)
    _rewrite_single_shard(tmp_path, tensors)
    with pytest.raises(
        CheckpointError, match=r"unexpected text tensors 'model\.language_model\.layers\.1\.self_attn"
    ):
        load_model(tmp_path)


def test_untied_model_without_lm_head_is_missing_it(tmp_path: Path) -> None:
    write_tiny_checkpoint(tmp_path)
    tensors = _stored(tmp_path)
    del tensors["lm_head.weight"]
    _rewrite_single_shard(tmp_path, tensors)
    with pytest.raises(CheckpointError, match=r"missing tensors 'lm_head\.weight'"):
        load_model(tmp_path)


def test_shape_mismatch_names_tensor_and_shapes(tmp_path: Path) -> None:
    write_tiny_checkpoint(tmp_path, shards=2)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["intermediate_size"] = 96
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(
        CheckpointError,
        match=r"shape mismatch: 'model\.layers\.0\.mlp\.gate_proj\.weight' in model-0000\d-of-00002\.safetensors: expected \[96, 64\], found \[128, 64\]",
    ):
        load_model(tmp_path)


def test_unsupported_model_type(tmp_path: Path) -> None:
    write_tiny_checkpoint(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["model_type"] = "qwen3_next"
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(UnsupportedModelError, match="qwen3_next"):
        load_model(tmp_path)


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("num_key_value_heads", 0, "num_key_value_heads must be a positive integer, got 0"),
        ("head_dim", 32.5, "head_dim must be a positive integer, got 32.5"),
        ("intermediate_size", True, "intermediate_size must be a positive integer, got True"),
        ("rms_norm_eps", "tiny", "rms_norm_eps must be a positive number, got 'tiny'"),
        ("eos_token_id", 100_000, "eos_token_id must be a token id below vocab_size 384, got 100000"),
        ("layer_types", 5, "layer_types must be a list, got 5"),
        ("tie_word_embeddings", "no", "tie_word_embeddings must be true or false, got 'no'"),
        (
            "rope_parameters",
            {"rope_type": "default", "partial_rotary_factor": 2},
            r"partial_rotary_factor must be in \(0, 1\], got 2",
        ),
        (
            "rope_parameters",
            {"rope_type": "default", "partial_rotary_factor": 0.03},
            r"partial_rotary_factor 0.03 rotates 0 of head_dim 32's dimensions",
        ),
    ],
)
def test_a_malformed_config_value_is_named(tmp_path: Path, key: str, value: object, message: str) -> None:
    write_tiny_checkpoint(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw[key] = value
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match=re.escape(f"{tmp_path}: config.json: ") + message):
        open_checkpoint(tmp_path)


def test_a_config_larger_than_its_tensors_fails_before_allocating(tmp_path: Path) -> None:
    """Sizes no stored tensor has are refused on opening, not found by allocating them (8 TB here)."""
    write_tiny_checkpoint(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["hidden_size"] = 2**31
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(
        CheckpointError, match=r"shape mismatch: 'model.embed_tokens.weight' .*: expected \[384, 2147483648\]"
    ):
        open_checkpoint(tmp_path)


@pytest.mark.parametrize("cut", [1, 4096])
def test_truncated_shard_names_the_file(tmp_path: Path, cut: int) -> None:
    write_tiny_checkpoint(tmp_path, shards=3)
    shard = checkpoint_files(tmp_path)[1]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - cut])
    with pytest.raises(
        CheckpointError,
        match=rf"{shard.name}: truncated safetensors file: header says {len(data)} bytes, file has {len(data) - cut}",
    ):
        load_model(tmp_path)


def test_shard_cut_inside_its_header(tmp_path: Path) -> None:
    write_tiny_checkpoint(tmp_path)
    shard = tmp_path / SINGLE_FILE
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=rf"{SINGLE_FILE}: truncated safetensors file: header claims"):
        load_model(tmp_path)
    shard.write_bytes(b"\x01\x02")
    with pytest.raises(CheckpointError, match=rf"{SINGLE_FILE}: truncated safetensors file \(2 bytes"):
        load_model(tmp_path)


def test_index_naming_a_missing_shard(tmp_path: Path) -> None:
    write_tiny_checkpoint(tmp_path, shards=3)
    (tmp_path / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(
        CheckpointError, match=r"names shard 'model-00002-of-00003\.safetensors', which is not in"
    ):
        load_model(tmp_path)


def test_index_disagreeing_with_shards(tmp_path: Path) -> None:
    write_tiny_checkpoint(tmp_path, shards=2)
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    index["weight_map"]["model.norm.weight"] = _other_shard(tmp_path, "model.norm.weight")
    (tmp_path / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"says tensor 'model\.norm\.weight' is in"):
        load_model(tmp_path)


def _other_shard(directory: Path, name: str) -> str:
    index = json.loads((directory / INDEX_FILE).read_text())
    files = sorted(set(index["weight_map"].values()))
    return next(f for f in files if f != index["weight_map"][name])


def test_no_weights(tmp_path: Path) -> None:
    write_tiny_checkpoint(tmp_path)
    (tmp_path / SINGLE_FILE).unlink()
    with pytest.raises(CheckpointError, match=r"no weights: no \*\.safetensors files"):
        load_model(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"found \['pytorch_model\.bin'\]: only safetensors"):
        load_model(tmp_path)
    save_file({}, str(tmp_path / SINGLE_FILE))
    with pytest.raises(CheckpointError, match="no weights: the safetensors files hold no tensors"):
        load_model(tmp_path)


def test_no_directory_or_config(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"no config\.json"):
        load_model(tmp_path)
    with pytest.raises(CheckpointError, match="not a directory"):
        checkpoint_files(tmp_path / "absent")


@pytest.mark.parametrize("file_name", ["config.json", INDEX_FILE])
def test_bad_json_names_the_file(tmp_path: Path, file_name: str) -> None:
    write_tiny_checkpoint(tmp_path, shards=2)
    (tmp_path / file_name).write_text('{"model_type": "qwen3_5_text",')
    with pytest.raises(CheckpointError, match=re.escape(file_name) + ": not valid JSON"):
        load_model(tmp_path)


def test_bad_safetensors_header_json(tmp_path: Path) -> None:
    write_tiny_checkpoint(tmp_path)
    shard = tmp_path / SINGLE_FILE
    data = bytearray(shard.read_bytes())
    data[8] = ord("[") + 100  # the header's opening brace becomes garbage
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"{SINGLE_FILE}: safetensors header is not valid JSON"):
        load_model(tmp_path)


@pytest.mark.parametrize(("field", "value"), [("data_offsets", [0, float("inf")]), ("shape", [-4, -16])])
def test_a_safetensors_entry_out_of_range_is_named(tmp_path: Path, field: str, value: list[float]) -> None:
    write_tiny_checkpoint(tmp_path)
    shard = tmp_path / SINGLE_FILE
    data = shard.read_bytes()
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + length])
    name = next(n for n in header if n != "__metadata__")
    header[name][field] = value
    raw = json.dumps(header).encode()  # Python's json writes infinity as `Infinity`, and reads it back
    shard.write_bytes(len(raw).to_bytes(8, "little") + raw + data[8 + length :])
    with pytest.raises(
        CheckpointError, match=rf"{SINGLE_FILE}: (bad header entry for )?tensor '{re.escape(name)}'"
    ):
        load_model(tmp_path)


def test_default_model_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hf, "DEFAULT_MODEL_DIR", tmp_path / "default_model")
    with pytest.raises(CheckpointError, match="default model is not installed"):
        default_model_dir()
    write_tiny_checkpoint(tmp_path / "default_model")
    assert default_model_dir() == tmp_path / "default_model"
    assert load_model(dtype=torch.float32).config == ModelConfig.from_dir(tmp_path / "default_model")


# ---- peak memory --------------------------------------------------------------------------------

# Peak RSS of the load alone. ru_maxrss is not used: Linux carries the parent's RSS at fork over
# into the child's ru_maxrss, so pytest's own size would show. VmHWM is the peak of this process's
# memory, and writing 5 to clear_refs resets it to the current RSS after the warm-up.
_RSS_PROBE = textwrap.dedent(
    """
    import json, sys, torch
    torch.set_num_threads(1)
    from onestream.worker.loading import load_model

    def status_bytes(field):
        with open("/proc/self/status") as f:
            line = next(line for line in f if line.startswith(field + ":"))
        return int(line.split()[1]) * 1024

    load_model(sys.argv[2])  # warm-up: the first model built loads ~70 MiB of library code
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = status_bytes("VmRSS")
    model = load_model(sys.argv[1], dtype=getattr(torch, sys.argv[3]))
    peak = status_bytes("VmHWM")
    loaded = sum(p.numel() * p.element_size() for p in model.parameters())
    print(json.dumps({"added": peak - before, "loaded": loaded}))
    """
)


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
def test_peak_host_memory_is_about_the_loaded_weights(tmp_path: Path) -> None:
    large = tiny_config(  # 68M parameters: 270 MB of fp32 weights
        hidden_size=1024,
        intermediate_size=2816,
        num_attention_heads=8,
        head_dim=128,
        linear_num_key_heads=8,
        linear_num_value_heads=8,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
    )
    large_dir = write_tiny_checkpoint(tmp_path / "large", config=large, shards=2)
    tiny_dir = write_tiny_checkpoint(tmp_path / "tiny")
    file_bytes = sum(p.stat().st_size for p in checkpoint_files(large_dir))
    for dtype in ("bfloat16", "float32"):  # one process each: freed memory would be reused
        result = subprocess.run(
            [sys.executable, "-c", _RSS_PROBE, str(large_dir), str(tiny_dir), dtype],
            capture_output=True,
            text=True,
            check=True,
            timeout=300,
        )
        stats = json.loads(result.stdout.strip().splitlines()[-1])
        loaded, added = stats["loaded"], stats["added"]
        assert loaded > (0.45 if dtype == "bfloat16" else 0.95) * file_bytes
        assert added >= 0.9 * loaded  # the weights really are resident
        assert added <= 1.2 * loaded, (
            f"{dtype}: peak added {added / 2**20:.0f} MiB for {loaded / 2**20:.0f} MiB"
        )
