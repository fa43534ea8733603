"""The conditioned random model (worker/testing.conditioned_weights) that tools/gpu/quant_kld.sh measures the
quantized megakernel on: logits and residual updates scaled like a trained model's, and rows that give each K-quant
type of the presets its own 256-blocks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from onestream.worker.checkpoints.gguf_layout import tensor_place
from onestream.worker.checkpoints.quantize import preset_chooser
from onestream.worker.loading import expected_tensor_shapes
from onestream.worker.model import Qwen35ForCausalLM
from onestream.worker.quant import QuantType
from onestream.worker.testing import conditioned_config, conditioned_weights, random_weights


def _model(weights: dict[str, torch.Tensor], config) -> Qwen35ForCausalLM:
    model = Qwen35ForCausalLM(config)
    model.load_state_dict(weights)
    return model.eval()


@pytest.fixture(scope="module")
def config():
    return conditioned_config()


@pytest.fixture(scope="module")
def tokens(config) -> torch.Tensor:
    return torch.randint(0, config.vocab_size, (1, 256), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def run(config, tokens):
    """Logits and the residual stream before and after each layer of the conditioned model."""
    model = _model(conditioned_weights(config, seed=21), config)
    streams = []
    hooks = [
        layer.register_forward_hook(lambda _m, args, out: streams.append((args[0], out)))
        for layer in model.model.layers
    ]
    with torch.inference_mode():
        logits = model.forward(tokens)[0][0]
    for hook in hooks:
        hook.remove()
    return logits, streams


def _hidden(value):
    return value[0] if isinstance(value, tuple) else value


def test_logits_like_a_trained_model(run, tokens):
    logits, _ = run
    std = logits.std(-1).mean().item()
    assert 1.5 < std < 4.0  # the embedded model's: 3.0
    top = logits.softmax(-1).max(-1).values.mean().item()
    assert 0.2 < top < 0.8  # peaked rows (the embedded model: 0.58), not flat ones
    # Unrelated tokens: a perplexity of a few times V * exp(std^2 / 2), not random_weights' ~1e8-1e9.
    ppl = F.cross_entropy(logits[:-1], tokens[0, 1:]).exp().item()
    assert ppl < 1e7


def test_each_layer_changes_the_stream_modestly(run):
    _, streams = run
    assert len(streams) == 8
    for before, after in streams:
        before, after = _hidden(before), _hidden(after)
        ratio = ((after - before).norm() / before.norm()).item()
        assert 0.1 < ratio < 0.8, ratio


def test_unconditioned_model_for_contrast(config, tokens):
    """random_weights' scales on the same shapes: logits several times larger and a far worse perplexity."""
    small = conditioned_config(num_hidden_layers=4)
    model = _model(random_weights(small, seed=21), small)
    with torch.inference_mode():
        logits = model.forward(tokens)[0][0]
    assert F.cross_entropy(logits[:-1], tokens[0, 1:]).exp().item() > 1e8


@pytest.mark.parametrize(
    ("preset", "expected"),
    [
        ("q4_k_m", {QuantType.Q4_K, QuantType.Q6_K}),
        ("q5_k_m", {QuantType.Q5_K, QuantType.Q6_K}),
        ("q6_k", {QuantType.Q6_K}),
        ("q8_0", {QuantType.Q8_0}),
    ],
)
def test_presets_type_every_matrix_with_its_own_blocks(config, preset, expected):
    """Every GEMV row is a multiple of 256: no tensor falls back to a 32-block type (Q5_0, Q5_1, Q8_0 in a K
    preset, F16), and the presets together cover Q4_K, Q5_K, Q6_K and Q8_0."""
    choose = preset_chooser(preset, config)
    types = set()
    for name, shape in expected_tensor_shapes(config).items():
        place = tensor_place(name, config)
        qtype = choose(place.gguf_name, tuple(shape), place.block)
        if qtype != QuantType.F32:
            assert shape[-1] % 256 == 0, name
            types.add(qtype)
    assert types == expected
