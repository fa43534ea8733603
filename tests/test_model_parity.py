"""Parity of our Qwen3.5 model with transformers' Qwen3_5ForCausalLM on random checkpoints.

transformers (pure-torch paths: no fla, no causal_conv1d) writes each checkpoint with save_pretrained; we
load it by name and compare logits for a whole-prompt forward and for a chunked prefill followed by
single-token decode, each against transformers' own cached path. Weights are randomised everywhere (norms
included) and the output head is scaled so that distributions are peaked.
"""

from __future__ import annotations

import copy
import importlib.util
import math

import pytest
import torch

transformers = pytest.importorskip("transformers")
from onestream.worker.config import FULL_ATTENTION, LINEAR_ATTENTION, ModelConfig  # noqa: E402
from onestream.worker.loading import load_model  # noqa: E402
from transformers import DynamicCache, Qwen3_5ForCausalLM, Qwen3_5TextConfig  # noqa: E402

torch.set_num_threads(2)

F_, L_ = FULL_ATTENTION, LINEAR_ATTENTION
CONFIGS = {
    # tied, grouped DeltaNet heads (Hk=2, Hv=4), default interval-4 pattern
    "tied-hv4-hk2": ModelConfig(
        vocab_size=300, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, intermediate_size=128, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16, tie_word_embeddings=True,
    ),
    # untied, interval 2, MQA, dk != dv, half the head rotated
    "untied-interval2": ModelConfig(
        vocab_size=500, hidden_size=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1,
        head_dim=64, intermediate_size=160, linear_num_key_heads=2, linear_num_value_heads=2,
        linear_key_head_dim=32, linear_value_head_dim=16, layer_types=(L_, F_, L_),
        partial_rotary_factor=0.5, tie_word_embeddings=False,
    ),
    # all linear but one full layer (first), Hv = 3 Hk, kernel 3
    "untied-one-full": ModelConfig(
        vocab_size=1000, hidden_size=128, num_hidden_layers=5, num_attention_heads=2, num_key_value_heads=2,
        head_dim=64, intermediate_size=192, linear_num_key_heads=1, linear_num_value_heads=3,
        linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=3,
        layer_types=(F_, L_, L_, L_, L_), tie_word_embeddings=False,
    ),
}  # fmt: skip

LOGIT_SCALE = 5.0  # output head std * sqrt(H): logits of std ~5, so the top token is often > 50%


def randomize_(model: torch.nn.Module, config: ModelConfig, seed: int) -> None:
    """Random weights of every kind (zero-centred norms too), decays that keep a long memory."""
    g = torch.Generator().manual_seed(seed)
    h = config.hidden_size
    with torch.no_grad():
        for name, p in model.named_parameters():

            def normal(std: float, shape: torch.Size = p.shape) -> torch.Tensor:
                return torch.randn(shape, generator=g) * std

            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(0.05, 2.0, generator=g).log())
            elif name.endswith("dt_bias"):
                p.copy_(normal(0.5))
            elif name.endswith("linear_attn.norm.weight"):
                p.copy_(1.0 + normal(0.2))
            elif name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.copy_(normal(0.2))
            elif name.endswith("conv1d.weight"):
                p.copy_(normal(0.5))
            elif name == "lm_head.weight" or (
                name == "model.embed_tokens.weight" and config.tie_word_embeddings
            ):
                p.copy_(normal(LOGIT_SCALE / math.sqrt(h)))
            elif name == "model.embed_tokens.weight":
                p.copy_(normal(1.0))
            else:  # projections: unit-variance outputs
                p.copy_(normal(1.0 / math.sqrt(p.shape[-1])))


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request, tmp_path_factory):
    """(transformers model, our model loaded from its save_pretrained checkpoint, config)."""
    # Pin transformers' pure-torch DeltaNet and conv paths: the optimised kernels differ numerically.
    assert importlib.util.find_spec("fla") is None and importlib.util.find_spec("causal_conv1d") is None
    config = CONFIGS[request.param]
    torch.manual_seed(0)
    ref = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**config.to_hf_text_dict())).eval()
    randomize_(ref, config, seed=len(request.param))
    path = tmp_path_factory.mktemp(request.param)
    ref.save_pretrained(path)
    ours = load_model(path, dtype=torch.float32)
    return ref, ours, config


def assert_close_logits(ours: torch.Tensor, ref: torch.Tensor, rel: float = 1e-4) -> None:
    scale = ref.abs().max().item()
    err = (ours - ref).abs().max().item()
    assert err <= rel * scale, f"max |logit diff| {err:.3g} > {rel} x {scale:.3g}"


def assert_peaked(logits: torch.Tensor) -> None:
    top = logits.softmax(-1).max(-1).values
    assert (top > 0.5).float().mean() >= 0.25, f"distributions too flat: median top prob {top.median():.2f}"


def test_checkpoint_names_are_ours(pair):
    ref, ours, config = pair
    ref_names = set(ref.state_dict()) - ({"lm_head.weight"} if config.tie_word_embeddings else set())
    assert set(ours.state_dict()) == ref_names


def test_whole_prompt_forward(pair):
    ref, ours, config = pair
    ids = torch.randint(0, config.vocab_size, (2, 150), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = ref(ids).logits
        logits, hidden = ours(ids)
    assert_peaked(expected)
    assert logits.dtype == torch.float32 and hidden.shape == (2, 150, config.hidden_size)
    assert_close_logits(logits, expected)
    # the stateful path over the whole prompt at once (two 64-chunks and a tail)
    step = ours.forward_step(ids[1], ours.new_state(200))
    assert_close_logits(step.logits, expected[1])
    torch.testing.assert_close(step.hidden, hidden[1], rtol=1e-4, atol=1e-4)


def test_chunked_prefill_then_decode(pair):
    ref, ours, config = pair
    ids = torch.randint(0, config.vocab_size, (1, 77), generator=torch.Generator().manual_seed(2))
    pieces = [(0, 37), (37, 67)] + [(i, i + 1) for i in range(67, 77)]
    cache = DynamicCache(config=ref.config)
    state = ours.new_state(100)
    with torch.no_grad():
        whole = ref(ids).logits[0]
        for a, b in pieces:
            expected = ref(ids[:, a:b], cache=cache, use_cache=True).logits[0]
            got = ours.forward_step(ids[0, a:b], state)
            assert_close_logits(got.logits, expected)
            assert_close_logits(got.logits, whole[a:b])
    assert_peaked(whole)
    assert state.length == 77 and state.token_ids == ids[0].tolist()


def test_keep_states_verify_matches_transformers(pair):
    """A T>1 step with keep_states (recurrent form, token by token) still equals transformers' logits."""
    ref, ours, config = pair
    ids = torch.randint(0, config.vocab_size, (1, 48), generator=torch.Generator().manual_seed(3))
    state = ours.new_state(64)
    with torch.no_grad():
        expected = ref(ids).logits[0]
    ours.forward_step(ids[0, :40], state)
    got = ours.forward_step(ids[0, 40:], state, keep_states=True)
    assert_close_logits(got.logits, expected[40:])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_as_accurate_as_transformers(pair, dtype):
    """In bf16/fp16 our error against fp32 transformers is no worse than transformers' own in that dtype."""
    ref, ours, config = pair
    ids = torch.randint(0, config.vocab_size, (1, 70), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        exact = ref(ids).logits[0].softmax(-1)
        ref_half = copy.deepcopy(ref).to(dtype)
        ref_probs = ref_half(ids).logits[0].float().softmax(-1)
    half = copy.deepcopy(ours).to(dtype)
    for layer in half.model.layers:
        if not layer.is_full_attention:  # decay parameters are never rounded
            assert (
                layer.linear_attn.A_log.dtype == torch.float32
                and layer.linear_attn.dt_bias.dtype == torch.float32
            )
    state = half.new_state(80)
    steps = [half.forward_step(ids[0, :60], state)] + [
        half.forward_step(ids[0, i : i + 1], state) for i in range(60, 70)
    ]
    logits = torch.cat([s.logits for s in steps])
    assert logits.dtype == torch.float32 and steps[0].hidden.dtype == dtype

    def mean_tv(probs: torch.Tensor) -> float:
        return 0.5 * (probs - exact).abs().sum(-1).mean().item()

    ours_tv, ref_tv = mean_tv(logits.softmax(-1)), mean_tv(ref_probs)
    assert ours_tv <= 1.5 * ref_tv + 1e-3, f"{dtype}: our mean TV {ours_tv:.3g} vs transformers' {ref_tv:.3g}"


def test_forward_is_differentiable_everywhere(pair):
    """Training uses `forward`: every parameter gets a gradient through the chunked DeltaNet."""
    _, ours, config = pair
    model = copy.deepcopy(ours).train().requires_grad_(True)  # load_model freezes parameters
    ids = torch.randint(0, config.vocab_size, (2, 70), generator=torch.Generator().manual_seed(5))
    logits, _ = model(ids)
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    no_grad = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not no_grad, f"no gradient for {no_grad}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_matches_cpu(pair, dtype):
    _, ours, config = pair
    ids = torch.randint(0, config.vocab_size, (50,), generator=torch.Generator().manual_seed(6))
    cpu = ours.forward_step(ids, ours.new_state(64)).logits.softmax(-1)
    gpu_model = copy.deepcopy(ours).to("cuda", dtype)
    state = gpu_model.new_state(64)
    assert state.device.type == "cuda"
    steps = [gpu_model.forward_step(ids[:40].cuda(), state)]
    steps += [gpu_model.forward_step(ids[i : i + 1].cuda(), state) for i in range(40, 50)]
    probs = torch.cat([s.logits for s in steps]).softmax(-1).cpu()
    tv = 0.5 * (probs - cpu).abs().sum(-1)
    assert tv.mean() < (1e-4 if dtype == torch.float32 else 0.05), f"mean TV {tv.mean():.3g}"
