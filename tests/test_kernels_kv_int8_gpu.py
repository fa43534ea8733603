"""The megakernel on int8 KV caches (worker/kv_cache.py `Int8KVCache`, the builds' MK_KV_I8), GPU only.

The attention phase alone against the reference's int8 cache at short and long contexts; whole steps against the
reference running the same int8 caches; a verify launch bit for bit as its single steps; and greedy speculative
output as plain greedy's on the embedded model.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

HAS_GPU = torch.cuda.is_available() and importlib.util.find_spec("cupy") is not None
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU and cupy")]

if HAS_GPU:
    from onestream.kernels.diagnostics import DiagnosticRunner
    from onestream.kernels.layout import Phase
    from onestream.kernels.random_model import config_27b, random_model
    from onestream.kernels.runtime import MegakernelError
    from onestream.worker.kv_cache import dequantize_int8

BF16 = torch.bfloat16


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    assert torch.isfinite(out).all(), "non-finite values in the kernel output"
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


@pytest.fixture(scope="module")
def setup():
    model = random_model(config_27b(4), seed=1234)
    runner = DiagnosticRunner(model, kv_cache="int8")
    yield model, runner
    del runner, model
    torch.cuda.empty_cache()


def _full_layer(model) -> int:
    return next(i for i, layer in enumerate(model.model.layers) if layer.is_full_attention)


@pytest.mark.parametrize("pos", [0, 5, 1100, 20000])
@torch.no_grad()
def test_int8_attention_phase_against_the_reference_cache(setup, pos):
    """One chunk, a few, and a long context cut into splits: the new key and value quantized as `quantize_int8`
    quantizes the reference's, and the layer's output as the reference's reading the same cache."""
    model, runner = setup
    c = model.config
    li = _full_layer(model)
    layer = model.model.layers[li]
    state = model.new_state(max(512, pos + 1), kv_format="int8")
    cache = state.kv[li]
    cache.reserve(pos + 1)
    shape = (c.num_key_value_heads, pos, c.head_dim)
    cache.write(0, torch.randn(shape, device="cuda").to(BF16), torch.randn(shape, device="cuda").to(BF16))
    ref_cache = cache.copy_prefix(pos, capacity=pos + 1)
    h = torch.randn(1, c.hidden_size, device="cuda").to(BF16)
    runner.buf["h"][:1].copy_(h)
    for phase in (Phase.ATT_IN, Phase.ATT, Phase.ATT_OUT):
        runner.run_phase(phase, li, state, pos=pos, tokens=[0])
    cos, sin = model.rotary(torch.tensor([pos], device="cuda"), BF16)
    ref = h + layer.self_attn.step(layer.input_layernorm(h), cos, sin, ref_cache, pos)
    for levels, scale, ref_levels, ref_scale in (
        (cache.k, cache.k_scale, ref_cache.k, ref_cache.k_scale),
        (cache.v, cache.v_scale, ref_cache.v, ref_cache.v_scale),
    ):
        got = dequantize_int8(levels[:, pos], scale[:, pos], torch.float32)
        want = dequantize_int8(ref_levels[:, pos], ref_scale[:, pos], torch.float32)
        assert int(levels[:, pos].abs().max()) == 127 and rel_err(got, want) < 2e-2
    assert torch.equal(cache.k[:, :pos], ref_cache.k[:, :pos])  # earlier positions untouched
    assert rel_err(runner.buf["h"][:1], ref) < 1e-2


def _prefilled(model, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    prompt = torch.randint(0, model.config.vocab_size, (700,), device="cuda", generator=g)
    state = model.new_state(800, kv_format="int8")
    model.forward_step(prompt, state, logits="last")
    return state


@torch.no_grad()
def test_int8_steps_follow_the_reference_and_a_verify_launch_equals_its_single_steps(setup):
    """Teacher-forced steps against the reference's on the same int8 caches (700 positions: two attention
    chunks), and a launch of 4 tokens bit for bit as 4 single steps, caches included."""
    model, runner = setup
    state = _prefilled(model, seed=5)
    ref_state = state.clone()
    g = torch.Generator(device="cuda").manual_seed(6)
    tokens = torch.randint(0, model.config.vocab_size, (4,), device="cuda", generator=g)
    errors = []
    for t in tokens:
        out = runner.step(t.reshape(1), state)
        ref = model.forward_step(t.reshape(1), ref_state)
        errors.append(rel_err(out.logits, ref.logits))
    print(f"\n[int8 KV] logits rel err per step against the bf16 reference: {[f'{e:.2e}' for e in errors]}")
    assert max(errors) < 5e-2
    single = _prefilled(model, seed=5)
    wide = single.clone()
    singles = torch.cat([runner.step(t.reshape(1), single).logits.clone() for t in tokens])
    launch = runner.step(tokens, wide).logits.clone()
    assert torch.equal(launch, singles)
    li = _full_layer(model)
    for name in ("k", "v", "k_scale", "v_scale"):
        assert torch.equal(getattr(wide.kv[li], name)[:, :704], getattr(single.kv[li], name)[:, :704])


@torch.no_grad()
def test_the_runner_refuses_a_state_of_the_other_format(setup):
    model, runner = setup
    with pytest.raises(MegakernelError, match="int8 KV caches; the state's are auto"):
        runner.step(torch.zeros(1, dtype=torch.long, device="cuda"), model.new_state(64))


@torch.no_grad()
def test_greedy_speculative_output_equals_plain_greedy_on_int8_caches():
    """The engine on the megakernel with int8 caches: every k's greedy output is plain greedy's (verify
    launches, rollbacks and drafts on int8 caches), and the cycles ran on the kernel."""
    from onestream.worker.backend import create_backend
    from onestream.worker.engine import Engine
    from onestream.worker.evaluation import time_runs
    from onestream.worker.loading import default_model_dir

    path = default_model_dir()
    backend = create_backend(path, kind="megakernel", kv_cache="int8")
    engine = Engine(path, backend=backend)
    ids = engine.tokenizer.encode((Path(__file__).resolve().parents[1] / "worker" / "engine.py").read_text())
    prompts = [ids[s : s + 48] for s in range(0, 8 * 997, 997)]
    runs = time_runs(engine, prompts, [1, 3], max_tokens=32)  # raises on any mismatch
    for run in runs[1:]:
        print(
            f"\n[embedded, megakernel, int8 KV] k={run.k}: mean accepted length {run.mean_accepted_length:.2f}"
        )
        assert run.drafts > 0 and run.accepted_tokens > 0
    assert {2, 4} <= set(backend.runner._builds) and backend.runner.kv_cache == "int8"
