"""The megakernel on block-quantized weights (kernels/gemv_quant.cuh) against the reference on the same weights
(GPU only).

Two models with fresh random GGUF blocks (kernels/random_quant.py): a small one whose rows are whole 256-blocks,
each GEMV in one of the seven formats in turn (every format in one build), and the 27B shapes (4 layers, full
vocabulary) typed as a Q4_K_M file is (Q4_K, with Q6_K for the lm_head and the "more bits" layers' v / qkv /
down projections). GEMV phases run alone and are compared with the dequantized weights in fp32; whole steps with
the fp32 reference on the same quantized weights; a verify launch of T tokens with T single steps.
"""

from __future__ import annotations

import copy
import importlib.util
import itertools

import pytest
import torch
import torch.nn.functional as F

HAS_GPU = torch.cuda.is_available() and importlib.util.find_spec("cupy") is not None
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU and cupy")]

if HAS_GPU:
    from onestream.kernels.diagnostics import DiagnosticRunner
    from onestream.kernels.layout import Phase
    from onestream.kernels.random_model import config_27b, random_model
    from onestream.kernels.random_quant import preset_types, quantize_randomly
    from onestream.kernels.runtime import MegakernelRunner
    from onestream.kernels.tuning import Tuning
    from onestream.worker.checkpoints import open_checkpoint
    from onestream.worker.checkpoints.gguf_writer import write_gguf
    from onestream.worker.layers.quantized import PermutedInputLinear
    from onestream.worker.loading import load_model
    from onestream.worker.quant import QuantizedEmbedding, QuantizedLinear, QuantType
    from onestream.worker.testing import tiny_config, write_tiny_checkpoint

FORMATS = ["Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q4_0", "Q5_0", "Q5_1"]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    assert torch.isfinite(out).all(), "non-finite values in the kernel output"
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def dequantized(module) -> torch.Tensor:
    """The fp32 weight of a quantized module (worker/quant's dequantization: what the kernel multiplies)."""
    return module.dequantize(torch.float32)


def small_config():
    # Every GEMV input (hidden 256, the MLP's 512, attention 4 x 64, DeltaNet values 4 x 64, the MTP fc's 512)
    # is whole 256-blocks, so that each K-quant runs unchanged.
    return tiny_config(
        hidden_size=256, intermediate_size=512, head_dim=64, linear_key_head_dim=64, linear_value_head_dim=64
    )


@pytest.fixture(scope="module")
def mixed():
    """The small model with each GEMV (a group of tensors one phase streams) in the next format of FORMATS."""
    model = random_model(small_config(), seed=11)
    cycle = itertools.cycle(FORMATS)
    group_of: dict[str, str] = {}

    def types(name: str, shape: tuple[int, int]) -> QuantType:
        # The tensors one GEMV streams share a format: in_proj_*, q/k/v, gate/up.
        key = name
        for member, group in (("in_proj_", "dn_in"), ("_proj.weight", "")):
            if member in name and (
                group or any(p in name for p in ("q_proj", "k_proj", "v_proj", "gate", "up"))
            ):
                key = name.rsplit(".", 2)[0] + "." + (group or "in")
                break
        if key not in group_of:
            group_of[key] = next(cycle)
        return QuantType[group_of[key]]

    chosen = quantize_randomly(model, types, seed=5)
    runner = DiagnosticRunner(model)
    print(f"\n[mixed] {sorted({t.name for t in chosen.values()})} runner: {runner.describe()}")
    yield model, runner, chosen
    del runner, model
    torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def q4_k_m_27b():
    model = random_model(config_27b(4), seed=3)
    chosen = quantize_randomly(model, preset_types(model, "q4_k_m"), seed=9)
    runner = DiagnosticRunner(model)
    print(f"\n[27b q4_k_m] {dict(sorted((n, t.name) for n, t in chosen.items() if 'layers.' not in n))}")
    print(f"runner: {runner.describe()}")
    yield model, runner, chosen
    del runner, model
    torch.cuda.empty_cache()


def all_layers(model) -> list:
    """The model's layers, then the MTP head's (the kernel's layer table rows)."""
    return (
        [*model.model.layers, *model.mtp.layers]
        if getattr(model, "mtp", None) is not None
        else [*model.model.layers]
    )


def check_mlp(model, runner, layer_index: int) -> tuple[float, float]:
    layer = all_layers(model)[layer_index]
    state = model.new_state(64)
    h = (torch.randn(1, model.config.hidden_size, device="cuda")).to(torch.bfloat16)
    runner.buf["h"][:1].copy_(h)
    runner.run_phase(Phase.MLP_IN, layer_index, state, pos=0, tokens=[0])
    act = runner.buf["act"][:1].clone()
    runner.run_phase(Phase.MLP_DOWN, layer_index, state, pos=0, tokens=[0])
    x = layer.post_attention_layernorm(h).float()
    mlp = layer.mlp
    ref_act = F.silu(x @ dequantized(mlp.gate_proj).T) * (x @ dequantized(mlp.up_proj).T)
    ref_h = h.float() + act.float() @ dequantized(mlp.down_proj).T  # on the kernel's own activation
    # act: bf16 roundings of gate, up and their product (about 3e-3); down: fp32 sums in another order.
    return rel_err(act, ref_act), rel_err(runner.buf["h"][:1].float() - h.float(), ref_h - h.float())


def check_lm_head(model, runner) -> float:
    state = model.new_state(64)
    h = torch.randn(1, model.config.hidden_size, device="cuda").to(torch.bfloat16)
    runner.buf["h"][:1].copy_(h)
    runner.run_phase(Phase.LM_HEAD, 0, state, pos=0, tokens=[0])
    lm = model.model.embed_tokens if model.config.tie_word_embeddings else model.lm_head
    # The kernel's own staged input (the post-norm hidden it writes out), times the dequantized weight.
    ref = runner.buf["hidden_out"][:1].float() @ dequantized(lm).T
    return rel_err(runner.buf["logits"][:1], ref)


# ---- per format, the small model ----------------------------------------------------------------------
@torch.no_grad()
@pytest.mark.parametrize("fmt", FORMATS)
def test_mlp_gemv_per_format(mixed, fmt):
    """Gate/up and down of a layer whose projections are in `fmt` (or the nearest layer that has it)."""
    model, runner, chosen = mixed
    checked = []
    n = model.config.num_hidden_layers
    for i, _ in enumerate(all_layers(model)):
        prefix = f"model.layers.{i}" if i < n else f"mtp.layers.{i - n}"
        for proj in ("gate_proj", "down_proj"):
            if chosen[f"{prefix}.mlp.{proj}.weight"].name == fmt:
                checked.append((i, proj))
    if not checked:
        pytest.skip(f"no MLP projection of the small model is {fmt}")
    for i, proj in checked:
        e_act, e_down = check_mlp(model, runner, i)
        print(f"{fmt} layer {i} {proj}: act {e_act:.2e} down {e_down:.2e}")
        assert (e_act < 1e-2) if proj == "gate_proj" else (e_down < 1e-3), (i, proj)


@torch.no_grad()
def test_every_format_is_in_the_mixed_build(mixed):
    _, runner, chosen = mixed
    assert {t.name for t in chosen.values()} == set(FORMATS)
    # No bf16 GEMV; Q8_0 and Q5_K units (3 ring vectors) keep the items in registers.
    assert runner.plan.stages == 0 and not runner.plan.streams_bf16


@torch.no_grad()
def test_small_lm_head(mixed):
    model, runner, _ = mixed
    assert check_lm_head(model, runner) < 1e-3


@torch.no_grad()
def steps_against_references(model, runner, steps: int) -> tuple[list[float], list[float], int]:
    """Teacher-forced steps of the kernel, the reference in the model's dtype (bf16: it rounds the dequantized
    weights to bf16) and the fp32 reference on the same quantized weights. Returns the logits' relative errors of
    the kernel and of the bf16 reference against fp32, and the greedy flips away from near-ties."""
    ref32 = copy.deepcopy(model).float()  # the quantized modules follow: they dequantize into fp32
    g = torch.Generator(device="cuda").manual_seed(4)
    prompt = torch.randint(0, model.config.vocab_size, (16,), device="cuda", generator=g)
    ref_state = model.new_state(128)
    model.forward_step(prompt, ref_state, logits="last")
    mk_state = ref_state.clone()
    ref32_state = ref32.new_state(128)
    ref32.forward_step(prompt, ref32_state, logits="last")
    token = torch.randint(0, model.config.vocab_size, (1,), device="cuda", generator=g)
    kernel, bf16, flips = [], [], 0
    for _ in range(steps):
        ref = model.forward_step(token, ref_state)
        out = runner.step(token, mk_state)
        truth = ref32.forward_step(token, ref32_state).logits[0]
        kernel.append(rel_err(out.logits[0], truth))
        bf16.append(rel_err(ref.logits[0], truth))
        gap = truth.topk(2).values
        near = float(gap[0] - gap[1]) <= 2 * float((truth - out.logits[0]).abs().max()) + 1e-6
        flips += int(out.logits[0].argmax()) != int(truth.argmax()) and not near
        token = ref.logits[0].argmax().reshape(1)
    del ref32
    torch.cuda.empty_cache()
    return kernel, bf16, flips


def assert_close_to_fp32(name: str, kernel: list[float], bf16: list[float], flips: int) -> None:
    print(
        f"\n[{name}] vs the fp32 reference per step: kernel {[f'{e:.1e}' for e in kernel]}, "
        f"bf16 reference {[f'{e:.1e}' for e in bf16]}; greedy flips {flips}"
    )
    assert flips == 0
    # The kernel multiplies the exact dequantized weights in fp32: no further from fp32 than the bf16 reference.
    assert sum(kernel) <= 1.25 * sum(bf16) + 1e-3 * len(kernel)


@torch.no_grad()
def test_small_decode_steps_match_the_fp32_reference(mixed):
    model, runner, _ = mixed
    assert_close_to_fp32("small, every format", *steps_against_references(model, runner, steps=8))


# ---- the 27B shapes, Q4_K_M -----------------------------------------------------------------------------
@torch.no_grad()
def test_q4_k_m_27b_gemvs(q4_k_m_27b):
    model, runner, chosen = q4_k_m_27b
    downs = {i: chosen[f"model.layers.{i}.mlp.down_proj.weight"].name for i in range(4)}
    assert set(downs.values()) == {"Q4_K", "Q6_K"}, downs  # both of the file's formats within one kind
    for i in range(4):
        e_act, e_down = check_mlp(model, runner, i)
        print(f"27b layer {i} (down {downs[i]}): act {e_act:.2e} down {e_down:.2e}")
        assert e_act < 1e-2 and e_down < 1e-3, i
    e = check_lm_head(model, runner)
    print(f"27b lm_head ({chosen['lm_head.weight'].name}): {e:.2e}")
    assert e < 1e-3


@torch.no_grad()
def test_q4_k_m_27b_steps_match_the_fp32_reference(q4_k_m_27b):
    model, runner, _ = q4_k_m_27b
    assert_close_to_fp32("27b q4_k_m", *steps_against_references(model, runner, steps=4))


@torch.no_grad()
@pytest.mark.parametrize("n", [4, 8])
def test_q4_k_m_27b_verify_launch_equals_single_steps(q4_k_m_27b, n):
    """A T = n launch gives each token the logits of its own single step, bit for bit (greedy speculative output
    equals plain greedy output): T = 4 streams 4-row items through the weight ring, T = 8 2-row items."""
    model, runner, _ = q4_k_m_27b
    g = torch.Generator(device="cuda").manual_seed(6)
    prompt = torch.randint(0, model.config.vocab_size, (8,), device="cuda", generator=g)
    tokens = torch.randint(0, model.config.vocab_size, (n,), device="cuda", generator=g)
    single = model.new_state(64)
    model.forward_step(prompt, single, logits="last")
    batch = single.clone()
    one = [runner.step(t.view(1), single).logits[0].clone() for t in tokens]
    many = runner.step(tokens, batch, keep_states=True).logits[:n].clone()
    plan = runner._build(n).plan
    print(f"\nT = {n}: {plan.quant_rows}-row items, {plan.stages} ring stages")
    for t in range(n):
        assert torch.equal(many[t], one[t]), (t, float((many[t] - one[t]).abs().max()))


# ---- a GGUF in llama.cpp's order, and the device's one copy of the weights ----------------------------------
@pytest.fixture(scope="module")
def tiled_gguf(tmp_path_factory):
    """The small model (2 key heads, 4 value heads, rows of 256) written by our writer as Q4_K_M in llama.cpp's
    tiled value-head order: ssm_out's one Q4_K block per row spans all four heads, so it keeps the file's columns."""
    tmp = tmp_path_factory.mktemp("tiled")
    source = write_tiny_checkpoint(tmp / "hf", config=small_config())
    path = write_gguf(open_checkpoint(source), tmp / "q4_k_m.gguf", preset="q4_k_m", device="cuda")
    model = load_model(path, device="cuda", dtype=torch.bfloat16)
    runner = DiagnosticRunner(model)
    yield model, runner
    del runner, model
    torch.cuda.empty_cache()


@torch.no_grad()
def test_a_gguf_in_llama_cpps_order_runs_on_the_megakernel(tiled_gguf):
    model, runner = tiled_gguf
    assert isinstance(model.model.layers[0].linear_attn.out_proj, PermutedInputLinear)
    assert runner.plan.dn_out_tiled and "MK_DN_OUT_TILED" in runner.plan.defines()
    assert_close_to_fp32("GGUF, tiled ssm_out", *steps_against_references(model, runner, steps=8))


@torch.no_grad()
def test_the_runner_keeps_one_copy_of_the_weights():
    """Device bytes: building the runner repacks every quantized weight and the model's modules drop their GGUF
    bytes, so the device grows by the runner's own buffers and the rows' padding, not by a second copy."""
    model = random_model(config_27b(2), seed=3)
    quantize_randomly(model, preset_types(model, "q4_k_m"), seed=9)
    quantized = [m for m in model.modules() if isinstance(m, (QuantizedLinear, QuantizedEmbedding))]
    raw = sum(m.raw.numel() for m in quantized)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    runner = MegakernelRunner(model)
    torch.cuda.synchronize()
    grown = torch.cuda.memory_allocated() - before
    own = [*runner.buf.values(), *runner._params.values(), runner.ctrl, runner._globals, runner._layers]
    own_bytes = sum(t.numel() * t.element_size() for t in own) + sum(
        b.sync.numel() * 8 for b in runner._builds.values()
    )
    padding = runner.weights.repacked_bytes - raw
    print(
        f"\nquantized {raw / 2**20:.1f} MiB, device grew {grown / 2**20:.1f} MiB (runner buffers "
        f"{own_bytes / 2**20:.1f}, row padding {padding / 2**20:.2f})"
    )
    assert all(m.raw.numel() == 0 for m in quantized)
    assert grown <= own_bytes + padding + (4 << 20)
    assert raw > 8 * (own_bytes + (4 << 20))  # a second copy could not hide in the slack
    del runner, model
    torch.cuda.empty_cache()


def assert_same_steps(model, a_runner, b_runner, *, seed: int, prompt_tokens: int, steps: int = 3) -> None:
    """Two builds step from the same reference-prefilled state, token for token: their logits are equal bit for bit."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    prompt = torch.randint(0, model.config.vocab_size, (prompt_tokens,), device="cuda", generator=g)
    state = model.new_state(64)
    model.forward_step(prompt, state, logits="last")
    other = state.clone()
    for token in torch.randint(0, model.config.vocab_size, (steps,), device="cuda", generator=g):
        a = a_runner.step(token.view(1), state).logits[0]
        b = b_runner.step(token.view(1), other).logits[0]
        assert torch.equal(a, b), float((a - b).abs().max())


@torch.no_grad()
def test_rows_per_item_do_not_change_results(mixed):
    """Items of 4 rows (the default at T = 1) and of 1 row give every format's logits bit for bit: a row's sums
    do not depend on the rows that share its item."""
    model, runner, _ = mixed
    assert runner.plan.quant_rows == 4
    single = DiagnosticRunner(model, tuning=Tuning(qrows=1))
    assert single.plan.quant_rows == 1
    assert_same_steps(model, runner, single, seed=12, prompt_tokens=8)
    del single
    torch.cuda.empty_cache()


@torch.no_grad()
@pytest.mark.parametrize("which", ["mixed", "q4_k_m_27b"])
def test_the_weight_ring_does_not_change_results(which, request):
    """Quantized items through the shared-memory ring (cp.async, the default where it fits) and through the
    register double buffer give every format's logits bit for bit: the ring only changes where a unit's bytes
    wait before they are multiplied (and shared scales, which lane copied them)."""
    model, _, _ = request.getfixturevalue(which)
    runner = DiagnosticRunner(model, tuning=Tuning(stages=2))
    registers = DiagnosticRunner(model, tuning=Tuning(stages=0))
    assert runner.plan.stages == 2 and registers.plan.stages == 0
    assert_same_steps(model, runner, registers, seed=13, prompt_tokens=6)
    del runner, registers
    torch.cuda.empty_cache()


# ---- a quantized embedding table ------------------------------------------------------------------------------
@torch.no_grad()
@pytest.mark.parametrize("fmt", ["Q4_K", "Q6_K", "Q8_0", "Q5_1"])
def test_a_quantized_embedding_steps_as_its_bf16_rows_do(fmt):
    """The kernel reads a quantized table's rows from the model's repacked copy, decoding each value as the
    reference's lookup does (fp32, then bf16), and keeps no bf16 copy: single steps, a verify launch of 4 tokens
    and an MTP step give, bit for bit, the logits of the same model holding the table's bf16 rows."""
    from onestream.kernels.plan import WeightFormat
    from onestream.kernels.quant_layout import FORMAT_CODES
    from onestream.kernels.random_quant import random_blocks
    from onestream.worker.quant import QuantizedWeight, install_quantized_weights

    model = random_model(small_config(), seed=21)
    quantize_randomly(model, lambda name, shape: QuantType.Q4_K, seed=22)
    shape = tuple(model.model.embed_tokens.weight.shape)
    qtype = QuantType[fmt]
    raw = random_blocks(qtype, shape, generator=torch.Generator(device="cuda").manual_seed(23), device="cuda")
    table = QuantizedWeight(qtype, shape, raw)
    twin = copy.deepcopy(model)
    twin.model.embed_tokens.weight.copy_(table.dequantize(torch.bfloat16))
    install_quantized_weights(model, {"model.embed_tokens.weight": table}, dtype=torch.bfloat16)
    quant, rows = MegakernelRunner(model), MegakernelRunner(twin)
    assert (
        quant.plan.embed_format is WeightFormat(fmt.lower()) and rows.plan.embed_format is WeightFormat.BF16
    )
    assert quant.plan.defines()["MK_EFMT"] == FORMAT_CODES[qtype] and "MK_EFMT" not in rows.plan.defines()
    # One copy of the table: the repacked one, which the kernel reads.
    assert model.model.embed_tokens.raw.numel() == 0
    assert quant._embed.data_ptr() == quant.weights._repacked[id(model.model.embed_tokens)].data.data_ptr()
    g = torch.Generator(device="cuda").manual_seed(24)
    prompt = torch.randint(0, model.config.vocab_size, (8,), device="cuda", generator=g)
    a = twin.new_state(64)
    twin.forward_step(prompt, a, logits="last")
    b = a.clone()
    for token in torch.randint(0, model.config.vocab_size, (3,), device="cuda", generator=g):
        x, y = quant.step(token.view(1), a), rows.step(token.view(1), b)
        assert torch.equal(x.logits[0], y.logits[0]), float((x.logits[0] - y.logits[0]).abs().max())
        assert torch.equal(x.hidden[0], y.hidden[0])
    if fmt == "Q4_K":  # the T = 4 build and the MTP head (its fc reads the embedding too)
        four = torch.randint(0, model.config.vocab_size, (4,), device="cuda", generator=g)
        x, y = quant.step(four, a, keep_states=True), rows.step(four, b, keep_states=True)
        assert torch.equal(x.logits[:4], y.logits[:4])
        hidden = x.hidden[:1].clone()
        pair = torch.randint(0, model.config.vocab_size, (1,), device="cuda", generator=g)
        x, y = quant.mtp_step(pair, hidden, a), rows.mtp_step(pair, hidden, b)
        assert torch.equal(x.logits[0], y.logits[0]), float((x.logits[0] - y.logits[0]).abs().max())
    del quant, rows, model, twin
    torch.cuda.empty_cache()


@torch.no_grad()
@pytest.mark.parametrize("fmt", FORMATS)
def test_the_device_reader_gives_the_dequantized_weights(mixed, fmt):
    """mk_dequant, the prefill's reader of the repacked weights, gives worker/quant's dequantization of the GGUF
    bytes rounded to bf16 (read_repacked's values), bit for bit: fresh random blocks, whole and gathered rows."""
    from onestream.kernels.quant_layout import read_repacked, repack
    from onestream.kernels.quant_weights import RepackedSource
    from onestream.kernels.random_quant import random_blocks
    from onestream.worker.quant import QuantizedWeight

    model, _, _ = mixed
    handed = [m for m in model.modules() if isinstance(m, (QuantizedLinear, QuantizedEmbedding))]
    assert handed and all(m.source.reader is not None for m in handed)
    reader = handed[0].source.reader
    qtype = QuantType[fmt]
    g = torch.Generator(device="cuda").manual_seed(31)
    for shape in ((37, 512), (3, 2816)):  # 2816 = 11 super-blocks: rows whose padding differs per format
        raw = random_blocks(qtype, shape, generator=g, device="cuda")
        source = RepackedSource(repack(qtype, raw, shape))
        source.reader = reader
        assert reader.reads(qtype, source.packed.data, torch.bfloat16)
        want = QuantizedWeight(qtype, shape, raw).dequantize(torch.float32).to(torch.bfloat16)
        assert torch.equal(read_repacked(source.packed).to(torch.bfloat16), want)
        got = source.dequantize(torch.bfloat16)
        assert torch.equal(got, want), float((got.float() - want.float()).abs().max())
        index = torch.tensor([[shape[0] - 1, 0], [1, 2]], device="cuda")
        assert torch.equal(source.rows(index, torch.bfloat16), want[index])
    # The model's own handed-over weights of this format read back as the torch reader reads them.
    for m in handed:
        if m.qtype == qtype:
            want = read_repacked(m.source.packed).to(torch.bfloat16)
            assert torch.equal(m.dequantize(torch.bfloat16), want)
