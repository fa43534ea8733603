"""Quantized weights in the model: swapped-in modules give exactly the model with the dequantized weights."""

from __future__ import annotations

import random

import pytest
import torch
from onestream.worker.model import Qwen35ForCausalLM
from onestream.worker.quant import (
    QuantizedEmbedding,
    QuantizedLinear,
    QuantizedWeight,
    QuantShapeError,
    QuantType,
    install_quantized_weights,
    quantized_nbytes,
)
from onestream.worker.testing import tiny_config
from torch import nn


@pytest.fixture
def seed() -> int:
    value = random.SystemRandom().randrange(2**31)
    print(f"seed {value}")
    return value


def quantizable(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every linear and embedding weight of the model, by parameter name."""
    return {
        f"{name}.weight": module.weight.detach()
        for name, module in model.named_modules()
        if isinstance(module, (nn.Linear, nn.Embedding))
    }


def quantized_and_reference(
    qtype: QuantType, seed: int, **config: object
) -> tuple[Qwen35ForCausalLM, Qwen35ForCausalLM, dict[str, QuantizedWeight]]:
    torch.manual_seed(seed)
    cfg = tiny_config(**config)
    model = Qwen35ForCausalLM(cfg).eval()
    weights = {name: QuantizedWeight.from_float(qtype, w) for name, w in quantizable(model).items()}
    reference = Qwen35ForCausalLM(cfg).eval()
    reference.load_state_dict(model.state_dict())
    with torch.no_grad():
        for name, weight in weights.items():
            reference.get_parameter(name).copy_(weight.dequantize())
    return model, reference, weights


@pytest.mark.parametrize("dequantize_once", [False, True])
@pytest.mark.parametrize(
    ("qtype", "config"),
    [
        (QuantType.Q8_0, {}),
        (
            QuantType.Q4_K,
            {"hidden_size": 256, "intermediate_size": 512, "head_dim": 64, "linear_value_head_dim": 64},
        ),
    ],
    ids=["Q8_0", "Q4_K"],
)
def test_quantized_model_equals_dequantized_weights(
    qtype: QuantType, config: dict[str, object], dequantize_once: bool, seed: int
) -> None:
    model, reference, weights = quantized_and_reference(qtype, seed, **config)
    install_quantized_weights(model, weights, dtype=torch.float32, dequantize_once=dequantize_once)
    assert isinstance(model.model.embed_tokens, QuantizedEmbedding)
    assert isinstance(model.model.layers[0].mlp.down_proj, QuantizedLinear)
    assert quantized_nbytes(model) == sum(w.nbytes for w in weights.values())
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(seed))
    logits, hidden = model(ids)
    expected_logits, expected_hidden = reference(ids)
    assert torch.equal(hidden, expected_hidden) and torch.equal(logits, expected_logits)
    mtp_logits, _ = model.mtp_forward(ids, hidden)
    assert torch.equal(mtp_logits, reference.mtp_forward(ids, expected_hidden)[0])
    state, expected_state = model.new_state(16), reference.new_state(16)
    step = model.forward_step(ids[0], state)
    assert torch.equal(step.logits, reference.forward_step(ids[0], expected_state).logits)


def test_compute_dtype_follows_the_model(seed: int) -> None:
    model, _, weights = quantized_and_reference(QuantType.Q8_0, seed)
    install_quantized_weights(model, weights, dtype=torch.float32)
    model.to(torch.bfloat16)
    assert model.dtype == torch.bfloat16
    proj = model.model.layers[0].mlp.up_proj
    assert proj.raw.dtype == torch.uint8 and proj.weight.dtype == torch.bfloat16
    logits, _ = model(torch.tensor([[1, 2, 3]]))
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()


def test_embedding_dequantizes_only_the_rows_it_reads(seed: int) -> None:
    table = torch.randn(64, 256, generator=torch.Generator().manual_seed(seed))
    weight = QuantizedWeight.from_float(QuantType.Q6_K, table)
    ids = torch.tensor([[3, 63], [0, 3]])
    assert torch.equal(QuantizedEmbedding(weight, torch.float32)(ids), weight.dequantize()[ids])
    assert weight.nbytes == 64 * 210


def test_install_names_what_does_not_fit(seed: int) -> None:
    model, _, weights = quantized_and_reference(QuantType.Q8_0, seed)
    name = "model.layers.0.mlp.up_proj.weight"
    wrong = QuantizedWeight.from_float(QuantType.Q8_0, torch.zeros(8, 64))
    with pytest.raises(QuantShapeError, match=rf"{name}: the model expects shape \[128, 64\]"):
        install_quantized_weights(model, {name: wrong}, dtype=torch.float32)
    with pytest.raises(QuantShapeError, match=r"model\.norm\.weight: only nn\.Linear and nn\.Embedding"):
        install_quantized_weights(model, {"model.norm.weight": weights[name]}, dtype=torch.float32)
    with pytest.raises(QuantShapeError, match="needs 34 uint8 bytes, got 33"):
        QuantizedWeight(QuantType.Q8_0, (1, 32), torch.zeros(33, dtype=torch.uint8))


def test_the_loader_installs_quantized_weights(seed: int) -> None:
    """`loading.fill_parameters` (what every checkpoint format feeds) keeps linear and embedding weights
    quantized and dequantizes any other quantized parameter into a plain one."""
    from onestream.worker.loading import fill_parameters, parameters_on_meta

    model, reference, weights = quantized_and_reference(QuantType.Q8_0, seed)
    values: dict[str, object] = {name: p.detach() for name, p in model.named_parameters()}
    values.update(weights)
    norm = "model.layers.0.input_layernorm.weight"
    values[norm] = QuantizedWeight.from_float(QuantType.F16, model.get_parameter(norm).detach()[None])
    with torch.no_grad():
        reference.get_parameter(norm).copy_(values[norm].dequantize()[0])  # type: ignore[union-attr]
    with parameters_on_meta():
        loaded = Qwen35ForCausalLM(model.config)
    fill_parameters(loaded, values.items(), dtype=torch.float32, device=torch.device("cpu"))  # type: ignore[arg-type]
    assert isinstance(loaded.model.layers[3].self_attn.q_proj, QuantizedLinear)
    assert isinstance(loaded.model.embed_tokens, QuantizedEmbedding)
    ids = torch.randint(0, model.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(seed))
    assert torch.equal(loaded(ids)[0], reference(ids)[0])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dequantize_once", [False, True])
def test_quantized_model_on_cuda(dequantize_once: bool, seed: int) -> None:
    config = {"hidden_size": 256, "intermediate_size": 512, "head_dim": 64, "linear_value_head_dim": 64}
    model, reference, weights = quantized_and_reference(QuantType.Q4_K, seed, **config)
    install_quantized_weights(model, weights, dtype=torch.float32, dequantize_once=dequantize_once)
    model.to("cuda").to(torch.bfloat16)
    reference.to("cuda").to(torch.bfloat16)
    assert model.model.layers[0].mlp.up_proj.raw.device.type == "cuda" and model.dtype == torch.bfloat16
    ids = torch.randint(0, model.config.vocab_size, (1, 16), device="cuda")
    logits, expected = model(ids)[0], reference(ids)[0]
    assert torch.allclose(logits, expected, rtol=1e-2, atol=1e-2)


def test_a_quantized_head_multiplies_a_slab_of_rows_at_a_time(
    monkeypatch: pytest.MonkeyPatch, seed: int
) -> None:
    """The logits of a quantized lm_head are the full product's (each output row is the same dot product); only
    one slab of the weight is dequantized at a time, which the stand-in counts."""
    from onestream.worker.quant import weight as weight_module

    torch.manual_seed(seed)
    head = QuantizedLinear(QuantizedWeight.from_float(QuantType.Q8_0, torch.randn(300, 64)), torch.float32)
    x = torch.randn(3, 64)
    full = torch.nn.functional.linear(x, head.weight)
    assert torch.equal(weight_module.linear_in_slabs(head, x), full)  # one slab: the plain product
    monkeypatch.setattr(weight_module, "SLAB_ELEMENTS", 64 * 128)
    widest = []
    read = head.read_rows
    monkeypatch.setattr(
        head, "read_rows", lambda index, dtype: widest.append(index.stop - index.start) or read(index, dtype)
    )
    out = weight_module.linear_in_slabs(head, x)
    assert widest == [128, 128, 44]
    torch.testing.assert_close(out, full, rtol=1e-6, atol=1e-6)
    assert weight_module.linear_in_slabs(nn.Linear(64, 8, bias=False), x) is None


def test_a_range_of_rows_reads_as_the_same_rows_by_index(seed: int) -> None:
    """A slice of rows (the head's slabs: no gather) gives what the same rows by index give, from the GGUF bytes,
    from a kept dequantized copy and from a repacked copy the module handed its bytes to."""
    from onestream.kernels.quant_layout import repack
    from onestream.kernels.quant_weights import RepackedSource

    torch.manual_seed(seed)
    weight = QuantizedWeight.from_float(QuantType.Q4_K, torch.randn(40, 256))
    index = torch.arange(7, 31)
    for module in (
        QuantizedLinear(weight, torch.float32),
        QuantizedLinear(weight, torch.float32, dequantize_once=True),
    ):
        assert torch.equal(
            module.read_rows(slice(7, 31), torch.float32), module.read_rows(index, torch.float32)
        )
    handed = QuantizedLinear(weight, torch.float32)
    handed.hand_over(RepackedSource(repack(weight.qtype, weight.raw, weight.shape)))
    want = weight.dequantize(torch.float32)[7:31]
    assert torch.equal(handed.read_rows(slice(7, 31), torch.float32), want)
    assert torch.equal(handed.read_rows(index, torch.float32), want)
