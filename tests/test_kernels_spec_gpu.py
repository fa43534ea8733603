"""Speculative decoding on the megakernel (GPU only): verify launches of T tokens, recorded DeltaNet states,
greedy acceptance on the device, MTP draft steps, and the engine's speculative output.

The central property: a token's result does not depend on the launch that runs it. Every reduction (GEMV rows,
norms, the DeltaNet recurrence, attention chunks) has the same order whatever T is, so a verify pass of T
tokens must be bit-identical to T single-token steps; greedy speculative decoding on the megakernel is then
token-for-token plain greedy decoding on the megakernel, with no near-tie exception.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

HAS_GPU = torch.cuda.is_available() and importlib.util.find_spec("cupy") is not None
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU and cupy")]

if HAS_GPU:
    from onestream.kernels.random_model import config_27b, random_model
    from onestream.kernels.runtime import MegakernelError, MegakernelRunner
    from onestream.kernels.tuning import Tuning
    from onestream.worker.errors import StateError
    from onestream.worker.testing import tiny_config

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module", params=["tiny", "27b-4layers"])
def setup(request):
    config = tiny_config() if request.param == "tiny" else config_27b(4, mtp=True)
    model = random_model(config, seed=77)
    runner = MegakernelRunner(model)
    runner.prepare(*range(2, 9))  # the widths these tests launch, compiled in parallel rather than one by one
    yield request.param, model, runner
    del runner, model
    torch.cuda.empty_cache()


def token_counts(name: str) -> list[int]:
    # At the 27B shapes, T >= 2 stages a narrower input window and crosses the wide inputs in passes.
    return [2, 3, 5, 8]


def prefilled(model, n_prompt: int = 29, max_len: int = 256, seed: int = 5):
    g = torch.Generator(device="cuda").manual_seed(seed)
    prompt = torch.randint(0, model.config.vocab_size, (n_prompt,), device="cuda", generator=g)
    state = model.new_state(max(max_len, n_prompt + 16))
    for start in range(0, n_prompt, 2048):  # pieces: long prompts on the reference
        model.forward_step(prompt[start : start + 2048], state, logits="last")
    return state


def assert_same_state(a, b, config) -> None:
    assert a.length == b.length
    for i in config.linear_attention_layers:
        assert torch.equal(a.conv[i], b.conv[i]), f"layer {i}: conv windows differ"
        assert torch.equal(a.recurrent[i], b.recurrent[i]), f"layer {i}: recurrent states differ"
    for i in config.full_attention_layers:
        n = a.length
        assert torch.equal(a.kv[i].k[:, :n], b.kv[i].k[:, :n]), f"layer {i}: keys differ"
        assert torch.equal(a.kv[i].v[:, :n], b.kv[i].v[:, :n]), f"layer {i}: values differ"


@pytest.mark.parametrize("n_prompt", [29, 125, 12000])
@torch.no_grad()
def test_verify_launch_is_bit_identical_to_single_steps(setup, n_prompt):
    """At 125 the verify launches reach past the first attention chunk (128 positions): they fold two chunks'
    partials where single steps before position 128 write their one chunk's output directly. At 12000 the chunks
    overfill the grid, and launches of different T cut them into splits of different sizes."""
    name, model, runner = setup
    c = model.config
    base = prefilled(model, n_prompt=n_prompt)
    for t in token_counts(name):
        tokens = torch.randint(0, c.vocab_size, (t,), device="cuda")
        single = base.clone()
        logits, hidden, argmax = [], [], []
        for j in range(t):
            out = runner.step(tokens[j : j + 1], single)
            logits.append(out.logits[0].clone())
            hidden.append(out.hidden[0].clone())
            argmax.append(out.tokens[0])
        multi = base.clone()
        out = runner.step(tokens, multi)
        assert torch.equal(out.logits, torch.stack(logits)), f"T={t}: logits differ from single steps"
        assert torch.equal(out.hidden, torch.stack(hidden)), f"T={t}: hidden differs from single steps"
        assert out.tokens == argmax
        assert_same_state(multi, single, c)


@torch.no_grad()
def test_keep_states_records_every_position_and_rollback_is_a_copy(setup):
    name, model, runner = setup
    c = model.config
    base = prefilled(model, seed=6)
    t = token_counts(name)[-1]
    tokens = torch.randint(0, c.vocab_size, (t,), device="cuda")
    after = [base.clone()]  # after[j]: the state after j single steps
    for j in range(t):
        nxt = after[-1].clone()
        runner.step(tokens[j : j + 1], nxt)
        after.append(nxt)
    # The record holds the positions after tokens 1..T-1 (the live state is the one after token T); the state
    # before the first token is not kept, so rolling all T tokens back fails with a clear error.
    state = base.clone()
    runner.step(tokens, state, keep_states=True)
    with pytest.raises(StateError, match=f"cannot roll back to position {base.length}"):
        state.rollback(t)
    for keep in range(1, t + 1):  # roll a verify pass back to every position it covered
        state = base.clone()
        runner.step(tokens, state, keep_states=True)
        hist = state.history
        assert hist is not None and hist.start == base.length + 1 and hist.end == base.length + t - 1
        for j in range(t - 1):
            for i in c.linear_attention_layers:
                assert torch.equal(hist.recurrent[i][j], after[j + 1].recurrent[i]), f"entry {j}, layer {i}"
                assert torch.equal(hist.conv[i][j], after[j + 1].conv[i]), f"entry {j}, layer {i}"
        state.rollback(t - keep)
        assert_same_state(state, after[keep], c)
        # Decoding on from the rolled-back state continues exactly as the single-step path does.
        probe = torch.randint(0, c.vocab_size, (1,), device="cuda")
        mine = runner.step(probe, state).logits[0].clone()
        theirs = runner.step(probe, after[keep].clone()).logits[0]
        assert torch.equal(mine, theirs)


@torch.no_grad()
def test_history_is_taken_from_a_state_when_another_state_verifies(setup):
    _, model, runner = setup
    c = model.config
    if not c.linear_attention_layers:
        pytest.skip("no DeltaNet layers")
    first, second = prefilled(model, seed=8), prefilled(model, seed=9)
    runner.step(torch.randint(0, c.vocab_size, (2,), device="cuda"), first, keep_states=True)
    assert first.history is not None
    runner.step(torch.randint(0, c.vocab_size, (2,), device="cuda"), second, keep_states=True)
    assert first.history is None  # its record was overwritten: a rollback must fail, not use the other's
    with pytest.raises(Exception, match="roll back"):
        first.rollback(1)


@torch.no_grad()
def test_greedy_acceptance_on_the_device(setup):
    name, model, runner = setup
    c = model.config
    base = prefilled(model, seed=10)
    t = token_counts(name)[-1]
    # The greedy chain from a pending token: what a perfect drafter would propose.
    chain = [int(torch.randint(0, c.vocab_size, (1,)))]
    probe = base.clone()
    for _ in range(t - 1):
        chain.append(runner.step([chain[-1]], probe).tokens[0])
    for wrong_at in range(1, t + 1):  # inputs 1..wrong_at-1 are right, input wrong_at (if any) is not
        inputs = list(chain)
        if wrong_at < t:
            inputs[wrong_at] = (inputs[wrong_at] + 1) % c.vocab_size
        state = base.clone()
        out = runner.step(torch.tensor(inputs, device="cuda"), state, keep_states=True, accept=True)
        assert out.accepted == wrong_at - 1
        assert out.inputs == inputs
        assert out.tokens[: wrong_at - 1] == chain[1:wrong_at]


@torch.no_grad()
def test_mtp_steps_match_the_reference_mtp_head(setup):
    """Against the bf16 reference with the bf16-activation build (only summation order differs)."""
    name, model, _ = setup
    runner = MegakernelRunner(model, tuning=Tuning(fp32_act=False))
    c = model.config
    ref_state = prefilled(model, seed=11)
    h = c.hidden_size
    for t in (
        1,
        3,
        5,
        1,
    ):  # first draft steps over owed pairs, then a chained single step (27B, T = 5: in passes)
        mk_state = ref_state.clone()
        ids = torch.randint(0, c.vocab_size, (t,), device="cuda")
        hidden = (torch.randn(t, h, device="cuda") * 2).to(torch.bfloat16)
        ref = model.mtp_step(ids, hidden, ref_state)
        out = runner.mtp_step(ids, hidden, mk_state)
        rel = float((out.logits.double() - ref.logits.double()).norm() / ref.logits.double().norm())
        rel_h = float((out.hidden.double() - ref.hidden.double()).norm() / ref.hidden.double().norm())
        print(f"\n[{name}] MTP step of {t}: logits rel err {rel:.2e}, hidden {rel_h:.2e}")
        assert rel < 3e-2 and rel_h < 3e-2
        assert mk_state.mtp_length == ref_state.mtp_length
        n = ref_state.mtp_length
        k_err = (mk_state.mtp_kv.k[:, :n].float() - ref_state.mtp_kv.k[:, :n].float()).abs().max()
        assert float(k_err) < 0.1
        ref_state.mtp_kv.load_prefix(mk_state.mtp_kv, n)  # continue from the same cache


@torch.no_grad()
@pytest.mark.parametrize("pairs", [1, 3, 9])
@pytest.mark.parametrize("prefix", [False, True], ids=["whole-vocab", "draft-vocab"])
def test_an_mtp_chain_equals_its_steps_fed_by_the_host(setup, pairs, prefix):
    """The draft chain feeds each draft and hidden row back on the device: its drafts, MTP length and MTP cache
    are bit for bit those of single MTP launches fed the host's argmax and the previous launch's last hidden
    row. 9 pairs: more than a launch takes, the back end runs the first through `draft`. With a draft vocabulary
    the chain reads only the lm_head's first rows, and each draft is the host's argmax among those ids."""
    from onestream.kernels.backend import MegakernelBackend

    _, model, runner = setup
    c = model.config
    backend = MegakernelBackend(model)
    backend.draft_vocab = c.vocab_size // 3 // 8 * 8 if prefix else None
    vocab = backend.draft_vocab or c.vocab_size
    runner = backend.runner
    base = prefilled(model, seed=23)
    k = 4
    ids = torch.randint(0, c.vocab_size, (pairs,), device="cuda")
    hidden = (torch.randn(pairs, c.hidden_size, device="cuda") * 2).to(torch.bfloat16)
    stepped = base.clone()
    head = max(0, pairs - 8)
    if head:
        runner.mtp_step(ids[:head], hidden[:head], stepped)
    out = runner.mtp_step(ids[head:], hidden[head:], stepped)
    expected = [out.logits[-1:, :vocab].argmax(dim=-1)]
    for _ in range(k - 1):
        out = runner.mtp_step(expected[-1], out.hidden[-1:].clone(), stepped)
        expected.append(out.logits[-1:, :vocab].argmax(dim=-1))
    chained = base.clone()
    drafts = backend.draft_greedy(ids, hidden, chained, k)
    runner.check()
    assert torch.equal(drafts, torch.cat(expected))
    assert int(drafts.max()) < vocab
    n = stepped.mtp_length
    assert chained.mtp_length == n == pairs + k - 1
    assert torch.equal(chained.mtp_kv.k[:, :n], stepped.mtp_kv.k[:, :n])
    assert torch.equal(chained.mtp_kv.v[:, :n], stepped.mtp_kv.v[:, :n])
    # The main model's feedback run is not disturbed: a chain of steps after it as before it.
    token = int(drafts[0])
    assert runner.greedy_chain(token, chained, 3) == runner.greedy_chain(token, stepped, 3)


@torch.no_grad()
def test_each_cache_keeps_its_own_capacity(setup):
    """KV caches grow separately (prefill chunks, verify steps, the MTP head's own launches), so their
    capacities differ; each layer's attention must address its cache with that cache's per-head stride."""
    _, model, runner = setup
    c = model.config
    base = prefilled(model, seed=13, max_len=2048)
    grown = base.clone()
    for j, i in enumerate(c.full_attention_layers):
        grown.kv[i].reserve(
            700 + 400 * j
        )  # every main cache larger than the MTP cache, and unlike each other
    assert grown.kv[c.full_attention_layers[0]].capacity > base.kv[c.full_attention_layers[0]].capacity
    tokens = torch.randint(0, c.vocab_size, (3,), device="cuda")
    same = runner.step(tokens, base).logits.clone()
    assert torch.equal(runner.step(tokens, grown).logits, same)
    ids = torch.randint(0, c.vocab_size, (2,), device="cuda")
    hidden = (torch.randn(2, c.hidden_size, device="cuda") * 2).to(torch.bfloat16)
    same = runner.mtp_step(ids, hidden, base).logits.clone()
    assert grown.mtp_kv.capacity < grown.kv[c.full_attention_layers[0]].capacity
    assert torch.equal(runner.mtp_step(ids, hidden, grown).logits, same)


def test_backend_prepares_every_build_a_cycle_uses(setup):
    from onestream.kernels.backend import MegakernelBackend

    _, model, _ = setup
    backend = MegakernelBackend(model)
    backend.prepare(3)
    assert set(backend.runner._builds) == {1, 2, 3, 8}  # 8: the launches short prompts run as


@torch.no_grad()
@pytest.mark.parametrize("n", [5, 8, 13, 17])
def test_a_short_prompt_runs_as_launches_equal_to_single_steps(setup, n):
    """A short prompt prefills as back-to-back launches of up to 8 tokens: the state it leaves, its last logits
    and every hidden row (the MTP backlog's) bit for bit those of n single decode steps; a prompt past the bound,
    or one needing a launch size not built yet, takes the fast prefill path and compiles nothing."""
    from onestream.kernels.backend import MegakernelBackend, launch_pieces

    _, model, _ = setup
    backend = MegakernelBackend(model, launch_prefill_tokens=32)
    backend.prepare(1)  # launches of 1 and 8 tokens
    backend.runner.prepare(5)
    assert launch_pieces(n) in ([5], [8], [8, 5], [8, 8, 1])
    ids = torch.randint(0, model.config.vocab_size, (n,), device="cuda")
    state = backend.new_state(128)
    out = backend.prefill(ids, state)
    steps = backend.new_state(128)
    rows = [backend.decode(ids[i : i + 1], steps) for i in range(n)]
    assert state.length == steps.length == n
    assert torch.equal(out.logits[-1], rows[-1].logits[-1])
    assert torch.equal(out.hidden, torch.cat([r.hidden for r in rows]))
    after = torch.randint(0, model.config.vocab_size, (1,), device="cuda")
    assert torch.equal(backend.decode(after, state).logits, backend.decode(after, steps).logits)

    built = set(backend.runner._builds)
    for length in (33, 30):  # past the bound; 30 = 3 x 8 + 6, and no launch of 6 is built
        fast = backend.new_state(128)
        prompt = torch.randint(0, model.config.vocab_size, (length,), device="cuda")
        assert backend.prefill(prompt, fast).hidden.shape[0] == length and fast.length == length
    assert set(backend.runner._builds) == built


@torch.no_grad()
def test_bad_launches_are_clear_errors(setup):
    _, model, runner = setup
    state = prefilled(model, seed=12)
    with pytest.raises(MegakernelError, match=r"1\.\.8 tokens"):
        runner.step(torch.zeros(9, dtype=torch.long, device="cuda"), state)
    with pytest.raises(MegakernelError, match="at least one draft"):
        runner.step(torch.zeros(1, dtype=torch.long, device="cuda"), state, accept=True)
    with pytest.raises(MegakernelError, match="hidden must have shape"):
        runner.mtp_step(
            [1, 2], torch.zeros(1, model.config.hidden_size, device="cuda", dtype=torch.bfloat16), state
        )


# ---- the engine ----------------------------------------------------------------------------------------
def _code_prompts(tokenizer, n: int, length: int) -> list[list[int]]:
    """Prompts cut from this repository's own Python sources (present wherever the tests run)."""
    prompts = []
    for path in sorted((REPO / "worker").glob("*.py")) + sorted((REPO / "cluster").glob("*.py")):
        ids = tokenizer.encode(path.read_text())
        for start in range(0, max(0, len(ids) - length), 997):
            prompts.append(ids[start : start + length])
            if len(prompts) == n:
                return prompts
    return prompts


@torch.no_grad()
@pytest.mark.parametrize("draft_vocab", [None, 1024], ids=["whole-vocab", "draft-vocab-1024"])
def test_greedy_speculative_output_equals_plain_greedy_on_the_megakernel(draft_vocab):
    """Greedy speculative output is plain greedy's on the kernel, for every k, with the drafts among every token
    id or the first 1,024 (an eighth of the embedded model's, as the first 32,768 are of a 248,320 vocabulary)."""
    from onestream.kernels.backend import MegakernelBackend
    from onestream.worker.engine import Engine
    from onestream.worker.evaluation import time_runs
    from onestream.worker.loading import default_model_dir, load_model

    path = default_model_dir()
    backend = MegakernelBackend(load_model(path, dtype=torch.bfloat16, device="cuda"))
    backend.draft_vocab = draft_vocab
    engine = Engine(path, backend=backend)
    engine.draft_vocabulary = None  # the stated prefix throughout, not one learnt from the output
    tokenizer = engine.tokenizer
    prompts = _code_prompts(tokenizer, 24, 48)
    assert len(prompts) == 24
    runs = time_runs(engine, prompts, [1, 2, 3, 4], max_tokens=40)  # raises on any mismatch
    for run in runs[1:]:
        print(
            f"\n[embedded, megakernel, draft vocabulary {draft_vocab}] k={run.k}: mean accepted length "
            f"{run.mean_accepted_length:.2f}, "
            f"{run.tokens_per_s:.0f} tok/s (plain {runs[0].tokens_per_s:.0f})"
        )
        assert run.drafts > 0 and run.accepted_tokens > 0
    # The cycles ran on the kernel: verify builds of k + 1 tokens exist.
    assert {2, 3, 4, 5} <= set(backend.runner._builds)


@torch.no_grad()
def test_sampled_speculative_decoding_runs_on_the_megakernel():
    from onestream.kernels.backend import MegakernelBackend
    from onestream.worker.api import GenerateRequest, SamplingParams
    from onestream.worker.engine import Engine
    from onestream.worker.loading import default_model_dir, load_model

    path = default_model_dir()
    engine = Engine(path, backend=MegakernelBackend(load_model(path, dtype=torch.bfloat16, device="cuda")))
    tokenizer = engine.tokenizer
    engine.spec_k = 3
    request = GenerateRequest(
        tokenizer.encode("def parse(line):\n"),
        SamplingParams(temperature=0.8, top_p=0.95, seed=3),
        max_tokens=48,
        ignore_eos=True,
    )
    ids, usage = [], None
    for item in engine.generate(request):
        if hasattr(item, "token_ids"):
            ids.extend(item.token_ids)
        else:
            usage = item.usage
    assert len(ids) == 48 and all(0 <= i < engine.config.vocab_size for i in ids)
    assert usage is not None and usage.drafts > 0


@torch.no_grad()
def test_sampled_speculative_output_keeps_plain_samplings_distribution(tmp_path: Path) -> None:
    """Issue 23: sampled requests verified on the device with speculative rejection sampling are distributed as
    plain sampling. On the megakernel, a tiny model whose MTP head drafts well (some drafts accepted, some
    rejected): the first three tokens of 800 seeded requests with k = 2 MTP drafts against 800 without drafts,
    a two-sample chi-square over the frequent triples at the 0.999 level (the CPU reference's counterpart:
    tests/test_speculative.py)."""
    from onestream.kernels.backend import MegakernelBackend
    from onestream.worker.api import Finished, GenerateRequest, SamplingParams
    from onestream.worker.engine import Engine
    from onestream.worker.loading import load_model
    from onestream.worker.testing_spec import write_draftable_checkpoint

    directory = write_draftable_checkpoint(tmp_path / "draftable", seed=5, draft_noise=0.6)
    engine = Engine(
        directory, backend=MegakernelBackend(load_model(directory, dtype=torch.bfloat16, device="cuda"))
    )
    prompt = list(range(1, 20))
    runs = 800
    counts: dict[int, dict[tuple[int, ...], int]] = {0: {}, 2: {}}
    drafts = accepted = 0
    for k, seen in counts.items():
        engine.spec_k = k
        for seed in range(runs):
            request = GenerateRequest(
                prompt, SamplingParams(temperature=1.0, seed=seed), max_tokens=3, ignore_eos=True
            )
            ids: list[int] = []
            for item in engine.generate(request):
                if isinstance(item, Finished):
                    drafts += item.usage.draft_tokens if k else 0
                    accepted += item.usage.accepted_draft_tokens if k else 0
                else:
                    ids.extend(item.token_ids)
            seen[tuple(ids[:3])] = seen.get(tuple(ids[:3]), 0) + 1
    assert 0 < accepted < drafts, (accepted, drafts)  # both the accepting and the rejecting path ran
    keys = [k for k in set(counts[0]) | set(counts[2]) if counts[0].get(k, 0) + counts[2].get(k, 0) >= 20]
    a = torch.tensor([counts[0].get(k, 0) for k in keys], dtype=torch.float64)
    b = torch.tensor([counts[2].get(k, 0) for k in keys], dtype=torch.float64)
    chi2 = float(((a - b) ** 2 / (a + b)).sum())
    dof = len(keys) - 1
    print(
        f"\n[sampled speculative, megakernel] {accepted}/{drafts} drafts accepted; chi-square {chi2:.1f}, {dof} dof"
    )
    assert dof >= 3
    bound = dof * (1 - 2 / (9 * dof) + 3.09 * (2 / (9 * dof)) ** 0.5) ** 3  # Wilson-Hilferty, 0.999
    assert chi2 < bound


@torch.no_grad()
def test_a_draft_vocabulary_the_kernel_cannot_take_is_refused(setup):
    """lm_head rows that are no multiple of 8, or more than the vocabulary: the host refuses them naming the
    value, and the kernel's own check (a control block written past the host's) raises its error."""
    from onestream.kernels.layout import CTRL_FLAG_FEEDBACK, MODE_MTP
    from onestream.worker.errors import InvalidRequestError

    _, model, runner = setup
    c = model.config
    state = prefilled(model, seed=29)
    ids = torch.tensor([1], device="cuda")
    hidden = torch.zeros(1, c.hidden_size, device="cuda", dtype=torch.bfloat16)
    for bad in (12, c.vocab_size + 8, -8):
        with pytest.raises(InvalidRequestError, match=str(bad)):
            runner.mtp_chain(ids, hidden, state.clone(), 2, vocab=bad)
    runner.bind(state, state.mtp_length + 1, tokens=1, mtp=True)
    runner._set_ctrl(state.mtp_length, [1], CTRL_FLAG_FEEDBACK, MODE_MTP, head_rows=12)
    runner.buf["mtp_hidden_in"][:1].copy_(hidden)
    runner._launch("mk_decode", 1)
    with pytest.raises(MegakernelError, match="lm_head rows"):
        runner.check()
    runner.reset()
