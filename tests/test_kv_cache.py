"""KV cache formats (worker/kv_cache.py): the int8 cache's rounding, its growth and prefix copies, a state and an
engine running on it, the back ends that take it, and what the memory plan counts for it."""

from __future__ import annotations

import pytest
import torch
from onestream.worker.api import GenerateRequest, SamplingParams
from onestream.worker.backend import create_backend
from onestream.worker.config import ModelConfig
from onestream.worker.engine import Engine
from onestream.worker.errors import BackendUnavailableError, InvalidRequestError
from onestream.worker.kv_cache import (
    INT8_TOP,
    KV_CHUNK,
    KV_FORMATS,
    Cache,
    Int8KVCache,
    KVCache,
    dequantize_int8,
    kv_vector_bytes,
    new_kv_cache,
    quantize_int8,
)
from onestream.worker.loading import default_model_dir
from onestream.worker.memory import device_memory, dtype_weight_types
from onestream.worker.model import Qwen35ForCausalLM
from onestream.worker.state import StateError
from onestream.worker.testing import random_weights, tiny_config

torch.set_num_threads(2)


def test_int8_rounding_keeps_each_value_within_half_a_step() -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 7, 64, generator=g) * torch.logspace(-3, 2, 7)[None, :, None]
    x[1, 2] = 0.0  # a zero vector: zero levels and scale
    levels, scale = quantize_int8(x)
    assert levels.dtype == torch.int8 and scale.shape == (3, 7)
    assert int(levels.abs().max()) == INT8_TOP and scale[1, 2] == 0 and not levels[1, 2].any()
    torch.testing.assert_close(scale, x.abs().amax(-1) / INT8_TOP)
    error = (dequantize_int8(levels, scale, torch.float32) - x).abs()
    assert bool((error <= scale[..., None] / 2 * (1 + 1e-5) + 1e-12).all())


def test_an_int8_cache_grows_writes_and_copies_its_prefix() -> None:
    g = torch.Generator().manual_seed(2)
    cache = new_kv_cache("int8", 2, 16, 4 * KV_CHUNK, torch.float32, torch.device("cpu"))
    assert isinstance(cache, Int8KVCache) and cache.capacity == 0
    k, v = torch.randn(2, 5, 16, generator=g), torch.randn(2, 5, 16, generator=g)
    keys, values = cache.write(0, k, v)
    assert keys.shape == (2, 5, 16) and cache.capacity == KV_CHUNK
    torch.testing.assert_close(keys, dequantize_int8(*quantize_int8(k), torch.float32))
    torch.testing.assert_close(values, dequantize_int8(*quantize_int8(v), torch.float32))
    more = torch.randn(2, KV_CHUNK, 16, generator=g)
    keys, _ = cache.write(5, more, more)  # grows past its capacity, keeping what it held
    assert cache.capacity == 2 * KV_CHUNK and keys.shape[1] == 5 + KV_CHUNK
    torch.testing.assert_close(keys[:, :5], dequantize_int8(*quantize_int8(k), torch.float32))
    copy = cache.copy_prefix(5)
    assert copy.capacity == 5 and torch.equal(copy.k[:, :5], cache.k[:, :5])
    assert torch.equal(copy.v_scale[:, :5], cache.v_scale[:, :5])
    fresh = Int8KVCache(2, 16, 4 * KV_CHUNK, torch.float32, torch.device("cpu"))
    fresh.load_prefix(copy, 5)
    assert torch.equal(fresh.k[:, :5], cache.k[:, :5]) and torch.equal(
        fresh.k_scale[:, :5], cache.k_scale[:, :5]
    )
    # 16 levels and one fp32 scale per head vector, keys and values: 2 x (16 + 4) bytes a head and position
    assert cache.nbytes() == 2 * 2 * cache.capacity * (16 + 4)


@pytest.mark.parametrize("kv_format", KV_FORMATS)
def test_reserving_room_held_keeps_the_tensors_and_growth_keeps_them_ordinary(kv_format: str) -> None:
    """A launch reserves every attention layer's cache: room already held changes nothing, and growth inside
    inference mode (the card's engine thread) still makes ordinary tensors that keep the positions written."""
    cache = new_kv_cache(kv_format, 2, 8, 4 * KV_CHUNK, torch.float32, torch.device("cpu"))
    cache.reserve(3)
    k = torch.randn(2, 3, 8)
    cache.write(0, k, -k)
    held, generation = cache._tensors(), Cache.generation
    with torch.inference_mode():
        cache.reserve(cache.capacity)
        assert all(a is b for a, b in zip(cache._tensors(), held, strict=True))
        assert Cache.generation == generation  # the megakernel's tables, which hold the addresses, stay bound
        cache.reserve(cache.capacity + 1)
    assert cache.capacity == 2 * KV_CHUNK
    assert Cache.generation > generation  # new tensors: whoever holds the old addresses must read them again
    generation = Cache.generation
    cache.copy_prefix(3)
    assert Cache.generation > generation
    assert not any(t.is_inference() for t in cache._tensors())
    keys, values = cache.write(3, k[:, :1], -k[:, :1])
    torch.testing.assert_close(keys[:, :3], k, atol=0.02, rtol=0.02)
    torch.testing.assert_close(values[:, :3], -k, atol=0.02, rtol=0.02)


def test_formats_are_named_and_sized() -> None:
    assert isinstance(new_kv_cache("auto", 1, 8, 16, torch.float32, torch.device("cpu")), KVCache)
    assert kv_vector_bytes("auto", 256) == 512 and kv_vector_bytes("int8", 256) == 260
    with pytest.raises(InvalidRequestError, match="auto, int8"):
        new_kv_cache("fp8", 1, 8, 16, torch.float32, torch.device("cpu"))


@pytest.fixture(scope="module")
def model() -> Qwen35ForCausalLM:
    cfg = tiny_config()
    m = Qwen35ForCausalLM(cfg)
    m.load_state_dict(random_weights(cfg, seed=5))
    return m.eval()


def test_a_state_on_an_int8_cache_decodes_close_to_the_models_dtype(model: Qwen35ForCausalLM) -> None:
    ids = torch.randint(0, model.config.vocab_size, (40,), generator=torch.Generator().manual_seed(6))
    plain, int8 = model.new_state(64), model.new_state(64, kv_format="int8")
    assert int8.kv_format == "int8" and all(isinstance(c, Int8KVCache) for c in int8.kv.values())
    a = torch.cat([model.forward_step(ids[i : i + 1], plain).logits for i in range(len(ids))])
    b = torch.cat([model.forward_step(ids[i : i + 1], int8).logits for i in range(len(ids))])
    assert not torch.equal(a, b)  # the cache is int8
    assert float((a - b).abs().max()) < 0.05 * float(a.abs().max())
    assert int8.nbytes() < plain.nbytes()


def test_snapshots_of_an_int8_state_restore_exactly_and_only_into_int8_states(
    model: Qwen35ForCausalLM,
) -> None:
    g = torch.Generator().manual_seed(7)
    ids, cont = torch.randint(0, 64, (30,), generator=g), torch.randint(0, 64, (6,), generator=g)
    state = model.new_state(64, kv_format="int8")
    model.forward_step(ids, state)
    snap = state.snapshot()
    clone = state.clone()
    first = torch.cat([model.forward_step(cont[i : i + 1], state).logits for i in range(6)])
    state.restore(snap)
    again = torch.cat([model.forward_step(cont[i : i + 1], state).logits for i in range(6)])
    cloned = torch.cat([model.forward_step(cont[i : i + 1], clone).logits for i in range(6)])
    assert torch.equal(first, again) and torch.equal(first, cloned)
    other = model.new_state(64)
    assert not other.can_restore(snap)
    with pytest.raises(StateError, match="KV cache format"):
        other.restore(snap)


def test_an_engine_generates_on_an_int8_cache_and_says_so() -> None:
    engine = Engine(default_model_dir(), backend="reference", device="cpu", kv_cache="int8", spec_k=2)
    assert engine.model_info()["kv_cache"] == "int8" and engine.backend.kv_format == "int8"
    request = GenerateRequest(
        "def add(a, b):\n", SamplingParams(temperature=0.0), max_tokens=24, ignore_eos=True
    )
    items = list(engine.generate(request))
    assert sum(len(getattr(i, "token_ids", ())) for i in items) == 24
    # The turn's state is cached on the int8 cache too: the next turn continues it.
    follow = GenerateRequest(
        "def add(a, b):\n" + "".join(getattr(i, "text", "") for i in items), max_tokens=4
    )
    assert any(getattr(i, "token_ids", ()) for i in engine.generate(follow))


def test_the_command_lines_offer_the_formats_there_are() -> None:
    from onestream.commands.generate import KV_CACHE_CHOICES

    assert KV_CACHE_CHOICES == KV_FORMATS


def test_a_back_end_checks_the_cache_format_before_loading_anything() -> None:
    if not torch.cuda.is_available():  # the megakernel takes int8 caches; without a GPU it says what it lacks
        with pytest.raises(BackendUnavailableError, match="needs a CUDA GPU"):
            create_backend(default_model_dir(), kind="megakernel", kv_cache="int8")
    with pytest.raises(InvalidRequestError, match="kv cache format"):
        create_backend(default_model_dir(), kind="reference", device="cpu", kv_cache="fp8")


def test_the_memory_plan_counts_an_int8_cache(model: Qwen35ForCausalLM) -> None:
    config: ModelConfig = model.config
    types = dtype_weight_types(config, torch.bfloat16)
    plain = device_memory(config, types, 4096, dtype=torch.bfloat16)
    int8 = device_memory(config, types, 4096, dtype=torch.bfloat16, kv_format="int8")
    d = config.head_dim
    assert int8.kv_cache * (2 * d) == plain.kv_cache * (d + 4)
    assert int8.total < plain.total
