"""GGUF models: written with the `gguf` package's writer, loaded through our reader, checked against the
weights they came from, run end to end; and every malformed file named for what is wrong with it."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType
from onestream.worker.checkpoints import open_checkpoint
from onestream.worker.checkpoints.gguf_layout import from_gguf, tensor_place, to_gguf
from onestream.worker.checkpoints.gguf_writer import write_gguf
from onestream.worker.engine import Engine, Finished, GenerateRequest, SamplingParams
from onestream.worker.errors import CheckpointError, UnsupportedModelError
from onestream.worker.loading import (
    default_model_dir,
    expected_tensor_shapes,
    fill_parameters,
    load_model,
    parameters_on_meta,
)
from onestream.worker.model import Qwen35ForCausalLM
from onestream.worker.quant import QuantType, quantize
from onestream.worker.testing import tiny_config, write_tiny_checkpoint

torch.set_num_threads(2)

BLOCK_32 = (QuantType.Q8_0, QuantType.Q4_0, QuantType.Q5_0, QuantType.Q5_1)
K_TYPES = (QuantType.Q4_K, QuantType.Q5_K, QuantType.Q6_K)
PLAIN = (QuantType.F16, QuantType.BF16)
TOKENS = torch.tensor([[3, 71, 20, 9, 33, 18, 44, 5, 61, 2, 90, 17]])


def mixed_chooser():
    """Every supported type somewhere: matrices whose rows are whole 256-blocks take the K-quants in turn,
    the others the 32-blocks and plain types in turn."""
    k_cycle = itertools.cycle(K_TYPES)
    other_cycle = itertools.cycle((*BLOCK_32, *PLAIN))

    def choose(name: str, shape: tuple[int, ...], block: int | None) -> QuantType:
        if len(shape) < 2 or "ssm_conv1d" in name:
            return QuantType.F32
        return next(k_cycle) if shape[-1] % 256 == 0 else next(other_cycle)

    return choose


def fast_quantizer(qtype: QuantType, weights: torch.Tensor) -> torch.Tensor:
    """`gguf`'s own quantizer where it has one (numpy, the 32-blocks), ours for the K-quants: fixtures that
    only need a file of these types get it in seconds (ours searches each block's scale)."""
    if qtype in BLOCK_32:
        raw = gguf.quants.quantize(weights.float().cpu().numpy(), GGMLQuantizationType[qtype.name])
        return torch.from_numpy(np.ascontiguousarray(raw))
    return quantize(qtype, weights)


def one_type(qtype: QuantType):
    def choose(name: str, shape: tuple[int, ...], block: int | None) -> QuantType:
        return QuantType.F32 if len(shape) < 2 or "ssm_conv1d" in name else qtype

    return choose


def kld(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    p, q = p_logits.log_softmax(-1), q_logits.log_softmax(-1)
    return float((p.exp() * (p - q)).sum(-1).mean())


def dequantized_reference(path: Path) -> Qwen35ForCausalLM:
    """The GGUF as a plain fp32 model: every weight dequantized by `gguf`'s own dequantizer into an ordinary
    parameter (through our name and value mapping, which test_value_heads_are_stored_tiled checks)."""
    config = open_checkpoint(path).config
    stored = {t.name: t for t in GGUFReader(path).tensors}

    def weights():
        for name, shape in expected_tensor_shapes(config).items():
            place = tensor_place(name, config)
            t = stored[place.gguf_name]
            values = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type))).float()
            yield name, from_gguf(values, place, config, shape)

    with parameters_on_meta():
        model = Qwen35ForCausalLM(config)
    fill_parameters(model, weights(), dtype=torch.float32, device=torch.device("cpu"))
    return model.eval()


# ---- the layout: names and value transformations -------------------------------------------------


def test_value_heads_are_stored_tiled() -> None:
    """With 2 key heads and 4 value heads, grouped order [k0v0, k0v1, k1v0, k1v1] is stored tiled
    [k0v0, k1v0, k0v1, k1v1]: value heads 0, 2, 1, 3."""
    config = tiny_config()
    assert (config.linear_num_key_heads, config.linear_num_value_heads) == (2, 4)
    dv = config.linear_value_head_dim
    z = torch.arange(4 * dv, dtype=torch.float32)[:, None].repeat(1, config.hidden_size)
    stored = to_gguf(z, tensor_place("model.layers.0.linear_attn.in_proj_z.weight", config), config)
    heads = stored[::dv, 0] // dv
    assert heads.tolist() == [0, 2, 1, 3]
    a_log = torch.tensor([0.1, 0.2, 0.3, 0.4])
    ssm_a = to_gguf(a_log, tensor_place("model.layers.0.linear_attn.A_log", config), config)
    assert torch.allclose(ssm_a, -torch.exp(a_log[[0, 2, 1, 3]]))
    out = torch.arange(4 * dv, dtype=torch.float32)[None, :].repeat(config.hidden_size, 1)
    stored_out = to_gguf(out, tensor_place("model.layers.0.linear_attn.out_proj.weight", config), config)
    assert (stored_out[0, ::dv] // dv).tolist() == [0, 2, 1, 3]
    norm = torch.full((config.hidden_size,), 0.25)
    assert torch.equal(to_gguf(norm, tensor_place("model.norm.weight", config), config), norm + 1)
    gated = torch.full((dv,), 0.75)  # the DeltaNet output norm is stored as it is
    assert torch.equal(
        to_gguf(gated, tensor_place("model.layers.0.linear_attn.norm.weight", config), config), gated
    )
    assert tensor_place("mtp.layers.0.self_attn.q_proj.weight", config).gguf_name == "blk.4.attn_q.weight"
    assert tensor_place("mtp.fc.weight", config).gguf_name == "blk.4.nextn.eh_proj.weight"


# ---- the embedded model, mixed types, MTP head -----------------------------------------------------


@pytest.fixture(scope="module")
def embedded_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("gguf") / "embedded-mixed.gguf"
    return write_gguf(
        open_checkpoint(default_model_dir()), out, choose=mixed_chooser(), quantizer=fast_quantizer
    )


def test_embedded_gguf_holds_every_type_and_the_mtp_head(embedded_gguf: Path) -> None:
    reader = GGUFReader(embedded_gguf)
    types = {t.tensor_type for t in reader.tensors}
    assert {GGMLQuantizationType[q.name] for q in (*BLOCK_32, *K_TYPES, *PLAIN, QuantType.F32)} <= types
    names = {t.name for t in reader.tensors}
    config = open_checkpoint(default_model_dir()).config
    mtp = config.num_hidden_layers
    assert {
        f"blk.{mtp}.nextn.eh_proj.weight",
        f"blk.{mtp}.attn_q.weight",
        f"blk.{mtp}.nextn.enorm.weight",
    } <= names
    assert reader.fields["qwen35.block_count"].contents() == config.num_hidden_layers + 1
    assert reader.fields["qwen35.nextn_predict_layers"].contents() == 1
    assert "output.weight" not in names  # tied


def test_embedded_gguf_config_tokenizer_and_template(embedded_gguf: Path) -> None:
    hf, ours = open_checkpoint(default_model_dir()), open_checkpoint(embedded_gguf)
    assert ours.format.container == "gguf" and ours.name == "embedded-mixed"
    for field in (
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "layer_types",
        "rms_norm_eps",
        "rope_theta",
    ):
        assert getattr(ours.config, field) == getattr(hf.config, field), field
    assert ours.config.mtp_num_hidden_layers == 1 and ours.config.tie_word_embeddings
    a, b = hf.tokenizer(), ours.tokenizer()
    text = "def main():\n    print('héllo wörld')  # 😀 <|im_end|>\n\tx = [1, 2, 3]"
    assert b.encode(text) == a.encode(text)
    assert b.decode(a.encode(text)) == text
    messages = [{"role": "user", "content": "hi"}]
    assert b.apply_chat_template(messages) == a.apply_chat_template(messages)
    assert set(b.eos_token_ids) <= set(a.eos_token_ids) and b.eos_token_ids


def test_embedded_gguf_agrees_with_its_dequantized_weights_and_the_source(embedded_gguf: Path) -> None:
    model = load_model(embedded_gguf, dtype=torch.float32)
    reference = dequantized_reference(embedded_gguf)
    logits, hidden = model.forward(TOKENS)
    ref_logits, ref_hidden = reference.forward(TOKENS)
    assert kld(ref_logits, logits) < 1e-6  # our quantized layers compute what gguf's dequantizer says
    mtp_logits, _ = model.mtp_forward(TOKENS[:, 1:], hidden[:, :-1])
    ref_mtp, _ = reference.mtp_forward(TOKENS[:, 1:], ref_hidden[:, :-1])
    assert kld(ref_mtp, mtp_logits) < 1e-6
    source = load_model(default_model_dir(), dtype=torch.float32)
    source_logits, _ = source.forward(TOKENS)
    assert kld(source_logits, logits) < 0.05  # 4- to 16-bit weights of a trained model


def test_embedded_gguf_generates_and_speculation_matches_greedy(embedded_gguf: Path) -> None:
    engine = Engine(embedded_gguf, backend="reference", device="cpu", dtype="fp32")
    assert engine.model_info()["format"] == "gguf Q8_0" or engine.model_info()["format"].startswith("gguf ")

    def run(spec_k: int) -> list[int]:
        engine.spec_k = spec_k
        request = GenerateRequest(
            "def fibonacci(n):", SamplingParams(temperature=0.0), max_tokens=24, ignore_eos=True
        )
        tokens: list[int] = []
        for item in engine.generate(request):
            if not isinstance(item, Finished):
                tokens += item.token_ids
        return tokens

    plain = run(0)
    assert len(plain) == 24
    assert run(2) == plain


# ---- random models: K-quants on rows of 256, round trips --------------------------------------------

K_CONFIG = {  # every matrix's rows (inputs) a multiple of 256; one DeltaNet and one attention layer
    "hidden_size": 256,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "head_dim": 64,
    "linear_key_head_dim": 64,
    "linear_value_head_dim": 64,
    "num_hidden_layers": 2,
    "layer_types": ("linear_attention", "full_attention"),
}


@pytest.fixture(scope="module")
def k_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("k") / "k256", config=tiny_config(**K_CONFIG))


def k_cycle():
    cycle = itertools.cycle(K_TYPES)

    def choose(name: str, shape: tuple[int, ...], block: int | None) -> QuantType:
        return QuantType.F32 if len(shape) < 2 or "ssm_conv1d" in name else next(cycle)

    return choose


def test_k_quant_model_matches_its_dequantized_weights(k_model_dir: Path, tmp_path: Path) -> None:
    """Every K-quant, on rows of 256 (value heads reordered: 2 key heads, 4 value heads), per call and once."""
    path = write_gguf(open_checkpoint(k_model_dir), tmp_path / "k.gguf", choose=k_cycle())
    stored = {t.tensor_type for t in GGUFReader(path).tensors}
    assert stored == {GGMLQuantizationType.F32, *(GGMLQuantizationType[q.name] for q in K_TYPES)}
    reference = dequantized_reference(path).forward(TOKENS)[0]
    for once in (False, True):
        model = load_model(path, dtype=torch.float32, dequantize_once=once)
        assert kld(reference, model.forward(TOKENS)[0]) < 1e-6
    source = load_model(k_model_dir, dtype=torch.float32).forward(TOKENS)[0]
    # A third of the matrices at 4.5 bits on a random model with peaked logits: 0.55 measured; a misplaced
    # head or block gives whole nats.
    assert kld(source, reference) < 1.0


def test_quantize_round_trip_and_quantize_on_load(k_model_dir: Path, tmp_path: Path) -> None:
    """HF -> our quantizer -> GGUF (q4_k_m) -> load, against the source and against --quantize on load."""
    path = write_gguf(open_checkpoint(k_model_dir), tmp_path / "q4_k_m.gguf", preset="q4_k_m")
    written = open_checkpoint(path)
    assert written.format.weights == "Q4_K_M"
    assert {"Q4_K", "Q6_K", "F32"} == {name for name, _ in written.format.tensor_types}
    source = load_model(k_model_dir, dtype=torch.float32).forward(TOKENS)[0]
    from_file = load_model(path, dtype=torch.float32).forward(TOKENS)[0]
    on_load = load_model(k_model_dir, dtype=torch.float32, quantize="q4_k_m")
    assert open_checkpoint(k_model_dir, quantize="q4_k_m").format.label == "safetensors fp32 -> q4_k_m"
    # A random model with peaked logits amplifies weight error (Q8_0: 0.04 here, 2e-4 on the trained
    # embedded model, docs/benchmarks.md); a misplaced head or block gives whole nats.
    assert kld(source, from_file) < 1.0
    assert kld(source, on_load.forward(TOKENS)[0]) < 1.0
    # the same blocks but for ssm_out's, whose file columns are in tiled order
    assert kld(from_file, on_load.forward(TOKENS)[0]) < 0.05


def test_a_gguf_in_llama_cpps_order_loads_to_its_source(tmp_path: Path) -> None:
    """A file whose value heads our writer reordered as llama.cpp's converter does (2 key heads, 4 value heads)
    loads to the model it was written from: every matrix holds Q8_0-exact values (levels times 2^-10, a 127 in
    each block), so the file is lossless and the loaded model differs from the source only in the order of
    ssm_out's sums (it keeps the file's tiled columns and permutes its input); the megakernel takes that
    order as it is (kernels/quant_weights.py)."""
    from onestream.kernels.quant_weights import DeviceWeights
    from onestream.worker.layers.quantized import PermutedInputLinear
    from safetensors.torch import load_file, save_file

    directory = write_tiny_checkpoint(tmp_path / "hf", config=tiny_config(**K_CONFIG))
    tensors = load_file(directory / "model.safetensors")
    generator = torch.Generator().manual_seed(7)
    for name, t in tensors.items():
        if t.dim() == 2:
            levels = torch.randint(-127, 128, t.shape, generator=generator).float()
            levels[:, ::32] = 127.0
            tensors[name] = levels * 2.0**-10
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    path = write_gguf(open_checkpoint(directory), tmp_path / "q8.gguf", choose=one_type(QuantType.Q8_0))
    source = load_model(directory, dtype=torch.float32)
    model = load_model(path, dtype=torch.float32)
    assert isinstance(model.model.layers[0].linear_attn.out_proj, PermutedInputLinear)
    expected, got = source.forward(TOKENS)[0], model.forward(TOKENS)[0]
    assert torch.allclose(got, expected, rtol=1e-4, atol=1e-4 * float(expected.abs().max()))
    weights = DeviceWeights(model, [*model.model.layers, *model.mtp.layers], has_mtp=True)
    assert weights.dn_out_tiled and weights.quantized
    # The reference reads the repacked copy now: the same model still.
    assert torch.equal(model.forward(TOKENS)[0], got)


def test_split_shards_load_as_one_model(k_model_dir: Path, tmp_path: Path) -> None:
    first = write_gguf(
        open_checkpoint(k_model_dir),
        tmp_path / "split.gguf",
        choose=one_type(QuantType.Q8_0),
        split_max_tensors=20,
    )
    shards = sorted(tmp_path.glob("split-*-of-*.gguf"))
    assert len(shards) > 1 and first == shards[0]
    (tmp_path / "whole").mkdir()
    whole = write_gguf(
        open_checkpoint(k_model_dir), tmp_path / "whole" / "w.gguf", choose=one_type(QuantType.Q8_0)
    )
    a = load_model(first, dtype=torch.float32).forward(TOKENS)[0]
    b = load_model(whole, dtype=torch.float32).forward(TOKENS)[0]
    assert torch.equal(a, b)
    assert open_checkpoint(tmp_path / "whole").path == tmp_path / "whole"  # a directory with one GGUF


# ---- malformed files ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def good_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = write_tiny_checkpoint(tmp_path_factory.mktemp("good") / "tiny")
    return write_gguf(
        open_checkpoint(directory), directory.parent / "good.gguf", choose=one_type(QuantType.Q8_0)
    )


def rewrite(
    source: Path,
    out: Path,
    *,
    drop: tuple[str, ...] = (),
    metadata: dict[str, tuple[object, GGUFValueType]] | None = None,
    tensors: dict[str, tuple[np.ndarray, GGMLQuantizationType | None]] | None = None,
    arch: str | None = None,
) -> Path:
    """`source` written again with tensors dropped or replaced and metadata changed."""
    reader = GGUFReader(source)
    writer = gguf.GGUFWriter(out, arch or str(reader.fields["general.architecture"].contents()))
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        sub = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), field.types[0], sub_type=sub)
    for name, (value, vtype) in (metadata or {}).items():
        writer.add_key_value(name, value, vtype)
    for t in reader.tensors:
        if t.name in drop:
            continue
        if tensors and t.name in tensors:
            data, raw_dtype = tensors[t.name]
            writer.add_tensor(t.name, data, raw_dtype=raw_dtype)
        else:
            writer.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def test_the_rewrite_helper_alone_changes_nothing(good_gguf: Path, tmp_path: Path) -> None:
    copy = rewrite(good_gguf, tmp_path / "copy.gguf")
    assert torch.equal(
        load_model(copy, dtype=torch.float32).forward(TOKENS)[0],
        load_model(good_gguf, dtype=torch.float32).forward(TOKENS)[0],
    )


def test_not_a_gguf(tmp_path: Path) -> None:
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"PK\x03\x04 this is a zip file" * 10)
    with pytest.raises(CheckpointError, match=r"model.gguf: not a GGUF file \(it starts with b'PK"):
        open_checkpoint(bad)


def test_another_architecture(good_gguf: Path, tmp_path: Path) -> None:
    with pytest.raises(
        UnsupportedModelError, match=r"general.architecture is 'llama'; this engine runs 'qwen35'"
    ):
        open_checkpoint(rewrite(good_gguf, tmp_path / "llama.gguf", arch="llama"))


def test_missing_tensor(good_gguf: Path, tmp_path: Path) -> None:
    path = rewrite(good_gguf, tmp_path / "m.gguf", drop=("blk.2.ssm_out.weight",))
    with pytest.raises(CheckpointError, match=r"missing tensors 'blk.2.ssm_out.weight'"):
        open_checkpoint(path)


def test_missing_mtp_tensor(good_gguf: Path, tmp_path: Path) -> None:
    path = rewrite(good_gguf, tmp_path / "m.gguf", drop=("blk.4.nextn.eh_proj.weight",))
    with pytest.raises(CheckpointError, match=r"missing tensors 'blk.4.nextn.eh_proj.weight'"):
        open_checkpoint(path)


def test_misshaped_tensor(good_gguf: Path, tmp_path: Path) -> None:
    wrong = np.zeros((64, 8), dtype=np.float32)
    path = rewrite(good_gguf, tmp_path / "s.gguf", tensors={"blk.0.ssm_conv1d.weight": (wrong, None)})
    with pytest.raises(
        CheckpointError,
        match=r"'blk.0.ssm_conv1d.weight': the metadata implies \[\d+, 4\], the file has \[64, 8\]",
    ):
        open_checkpoint(path)


def test_unexpected_tensor(good_gguf: Path, tmp_path: Path) -> None:
    extra = np.zeros((4, 64), dtype=np.float32)
    reader_names = {t.name for t in GGUFReader(good_gguf).tensors}
    assert "blk.9.attn_q.weight" not in reader_names
    out = tmp_path / "x.gguf"
    rewrite(good_gguf, out)  # then append one tensor
    reader = GGUFReader(out)
    writer = gguf.GGUFWriter(tmp_path / "x2.gguf", "qwen35")
    for name, field in reader.fields.items():
        if not name.startswith("GGUF.") and name != "general.architecture":
            sub = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
            writer.add_key_value(name, field.contents(), field.types[0], sub_type=sub)
    for t in reader.tensors:
        writer.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    writer.add_tensor("blk.9.attn_q.weight", extra)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(CheckpointError, match=r"unexpected tensors 'blk.9.attn_q.weight'"):
        open_checkpoint(tmp_path / "x2.gguf")


@pytest.mark.parametrize("cut", [1, 1000, 100_000])
def test_truncated_file(good_gguf: Path, tmp_path: Path, cut: int) -> None:
    data = good_gguf.read_bytes()
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(data[: len(data) - cut])
    with pytest.raises(CheckpointError, match=r"cut.gguf: truncated"):
        open_checkpoint(bad)


def test_truncated_or_missing_shard(k_model_dir: Path, tmp_path: Path) -> None:
    first = write_gguf(
        open_checkpoint(k_model_dir),
        tmp_path / "s.gguf",
        choose=one_type(QuantType.Q8_0),
        split_max_tensors=20,
    )
    shards = sorted(tmp_path.glob("s-*-of-*.gguf"))
    last = shards[-1]
    data = last.read_bytes()
    last.write_bytes(data[:-500])
    with pytest.raises(CheckpointError, match=rf"{last.name}: truncated"):
        open_checkpoint(first)
    last.unlink()
    with pytest.raises(
        CheckpointError, match=rf"split GGUF of {len(shards)} shards is missing '{last.name}'"
    ):
        open_checkpoint(first)


def test_unsupported_type(good_gguf: Path, tmp_path: Path) -> None:
    reader = GGUFReader(good_gguf)
    name = "blk.0.ffn_up.weight"
    tensor = next(t for t in reader.tensors if t.name == name)
    values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    q4_1 = gguf.quants.quantize(values, GGMLQuantizationType.Q4_1)
    path = rewrite(good_gguf, tmp_path / "q41.gguf", tensors={name: (q4_1, GGMLQuantizationType.Q4_1)})
    with pytest.raises(
        CheckpointError, match=rf"tensor '{name}' has type Q4_1, which this loader does not support"
    ):
        open_checkpoint(path)


def test_metadata_that_contradicts_the_tensors(good_gguf: Path, tmp_path: Path) -> None:
    path = rewrite(
        good_gguf, tmp_path / "c.gguf", metadata={"qwen35.feed_forward_length": (96, GGUFValueType.UINT32)}
    )
    with pytest.raises(
        CheckpointError,
        match=r"tensors disagree with the metadata's shapes: 'blk.0.ffn_gate.weight': the metadata implies \[96, 64\]",
    ):
        open_checkpoint(path)
    path = rewrite(
        good_gguf, tmp_path / "v.gguf", metadata={"qwen35.nextn_predict_layers": (0, GGUFValueType.UINT32)}
    )
    with pytest.raises(CheckpointError, match=r"unexpected tensors 'blk.4"):
        open_checkpoint(path)


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        (
            "qwen35.rope.dimension_count",
            (1 << 27) + 8,
            "qwen35.rope.dimension_count 134217736 must be even and at most qwen35.attention.key_length 32",
        ),
        ("qwen35.ssm.time_step_rank", 0, "qwen35.ssm.time_step_rank must be a positive integer, got 0"),
        (
            "qwen35.attention.head_count_kv",
            0,
            "qwen35.attention.head_count_kv must be a positive integer, got 0",
        ),
        ("tokenizer.ggml.eos_token_id", 1 << 20, "tokenizer.ggml.eos_token_id must be a token id below 384"),
    ],
)
def test_metadata_out_of_range_is_named(
    good_gguf: Path, tmp_path: Path, key: str, value: int, message: str
) -> None:
    path = rewrite(good_gguf, tmp_path / "r.gguf", metadata={key: (value, GGUFValueType.UINT32)})
    with pytest.raises(CheckpointError, match=re.escape(f"{path}: {message}")):
        open_checkpoint(path)


def test_metadata_that_is_not_utf8_is_named(good_gguf: Path, tmp_path: Path) -> None:
    template = str(GGUFReader(good_gguf).fields["tokenizer.chat_template"].contents()).encode()
    data = bytearray(good_gguf.read_bytes())
    at = data.find(template)
    data[at + 1] = 0xFF
    bad = tmp_path / "latin.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(
        CheckpointError, match=r"latin.gguf: metadata 'tokenizer.chat_template' is corrupt: 'utf-8'"
    ):
        open_checkpoint(bad)


def test_directory_with_two_models(good_gguf: Path, tmp_path: Path) -> None:
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / name).write_bytes(good_gguf.read_bytes())
    with pytest.raises(
        CheckpointError, match=r"holds several GGUF models \('a.gguf', 'b.gguf'\); name one file"
    ):
        open_checkpoint(tmp_path)


def test_tokenizer_override(good_gguf: Path) -> None:
    directory = good_gguf.parent / "tiny"
    ours = open_checkpoint(good_gguf, tokenizer_dir=directory).tokenizer()
    assert ours.encode("hello world") == open_checkpoint(directory).tokenizer().encode("hello world")
