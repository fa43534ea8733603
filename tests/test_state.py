"""SequenceState: snapshot / restore (full and light) / rollback / clone / nbytes, KV caches that do not reallocate
per token, and `forward_step`'s logits option."""

from __future__ import annotations

import pytest
import torch
from onestream.worker.errors import ContextLengthError, InvalidRequestError
from onestream.worker.model import Qwen35ForCausalLM
from onestream.worker.state import KV_CHUNK, SequenceState, StateError
from onestream.worker.testing import random_weights, tiny_config

torch.set_num_threads(2)


@pytest.fixture(scope="module")
def model() -> Qwen35ForCausalLM:
    cfg = tiny_config()
    weights = random_weights(cfg, seed=3)
    g = torch.Generator().manual_seed(4)
    for name in weights:
        if name.endswith("A_log"):  # slow decay: the state carries information over many tokens
            weights[name] = torch.empty(weights[name].shape).uniform_(0.05, 1.0, generator=g).log()
    m = Qwen35ForCausalLM(cfg)
    m.load_state_dict(weights)
    return m.eval()


def tokens(model: Qwen35ForCausalLM, n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, model.config.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))


def decode(model: Qwen35ForCausalLM, state: SequenceState, ids: torch.Tensor) -> torch.Tensor:
    return torch.cat([model.forward_step(ids[i : i + 1], state).logits for i in range(len(ids))])


def assert_states_close(a: SequenceState, b: SequenceState, atol: float = 1e-5) -> None:
    assert a.length == b.length and a.token_ids == b.token_ids
    for i in a.kv:
        torch.testing.assert_close(a.kv[i].k[:, : a.length], b.kv[i].k[:, : b.length], atol=atol, rtol=1e-4)
        torch.testing.assert_close(a.kv[i].v[:, : a.length], b.kv[i].v[:, : b.length], atol=atol, rtol=1e-4)
    for i in a.conv:
        torch.testing.assert_close(a.conv[i], b.conv[i], atol=atol, rtol=1e-4)
        torch.testing.assert_close(a.recurrent[i], b.recurrent[i], atol=atol, rtol=1e-4)


def test_snapshot_restore_reproduces_identical_logits(model):
    ids, cont, other = tokens(model, 30, 1), tokens(model, 6, 2), tokens(model, 6, 3)
    state = model.new_state(64)
    model.forward_step(ids, state)
    snap = state.snapshot()
    first = decode(model, state, cont)
    state.restore(snap)
    assert state.length == 30 and state.token_ids == ids.tolist()
    diverged = decode(model, state, other)
    assert not torch.equal(diverged, first)
    state.restore(snap)  # a snapshot survives restores and later writes
    assert torch.equal(decode(model, state, cont), first)


def test_keep_states_rollback_then_redecode(model):
    ids, verify = tokens(model, 25, 4), tokens(model, 7, 5)
    state = model.new_state(64)
    model.forward_step(ids, state)
    out = model.forward_step(verify, state, keep_states=True)
    state.rollback(7)  # back to where the verify started: the same call gives bit-identical logits
    assert torch.equal(model.forward_step(verify, state, keep_states=True).logits, out.logits)
    for n in (3, 1):  # successive rollbacks inside the recorded span
        state.rollback(n)
    assert state.length == 25 + 3 and state.token_ids == ids.tolist() + verify[:3].tolist()
    # a shorter call differs only by matmul blocking
    again = model.forward_step(verify[3:], state, keep_states=True)
    torch.testing.assert_close(again.logits, out.logits[3:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n", [0, 1, 4, 7])
def test_keep_states_rollback_equals_recomputation(model, n):
    ids, verify = tokens(model, 25, 6), tokens(model, 7, 7)
    state = model.new_state(64)
    model.forward_step(ids, state)
    model.forward_step(verify, state, keep_states=True)
    state.rollback(n)
    fresh = model.new_state(64)
    model.forward_step(torch.cat([ids, verify[: 7 - n]]), fresh)
    assert_states_close(state, fresh)
    nxt = tokens(model, 3, 8)
    torch.testing.assert_close(decode(model, state, nxt), decode(model, fresh, nxt), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("n", [1, 4, 6])
def test_rollback_copies_the_recorded_stacks_row_of_every_layer(model, n):
    """A rollback is two copies of the history's stacks (entry j of every layer at once) into the state's stacks,
    which the per-layer `conv` / `recurrent` tensors view: each layer then holds its own record j, successive
    rollbacks included, and writing a layer's state still writes the stack."""
    ids, verify = tokens(model, 25, 6), tokens(model, 7, 7)
    state = model.new_state(64)
    model.forward_step(ids, state)
    model.forward_step(verify, state, keep_states=True)
    hist = state.history
    assert hist is not None and hist.layers == tuple(state.conv)
    records = {i: (hist.conv[i].clone(), hist.recurrent[i].clone()) for i in hist.layers}
    for first in (n, 1):
        target = state.length - first
        state.rollback(first)
        for i in hist.layers:
            j = target - hist.start
            assert torch.equal(state.conv[i], records[i][0][j]) and torch.equal(
                state.recurrent[i], records[i][1][j]
            )
    assert state.length == 25 + 7 - n - 1
    layer = hist.layers[-1]
    state.recurrent[layer].add_(1.0)
    assert torch.equal(state._rec_stack[-1], state.recurrent[layer])


def test_speculative_style_cycles_match_plain_prefill(model):
    """Verify k+1 tokens with keep_states, accept some, roll back the rest, repeat."""
    state = model.new_state(128)
    accepted = tokens(model, 10, 9).tolist()
    model.forward_step(torch.tensor(accepted), state)
    for cycle, keep in enumerate([2, 5, 1, 4, 3]):
        block = tokens(model, 5, 100 + cycle)
        model.forward_step(block, state, keep_states=True)
        state.rollback(5 - keep)
        accepted += block[:keep].tolist()
    fresh = model.new_state(128)
    model.forward_step(torch.tensor(accepted), fresh)
    assert_states_close(state, fresh)


def test_rollback_past_the_record_is_refused(model):
    state = model.new_state(64)
    model.forward_step(tokens(model, 10, 10), state)
    model.forward_step(tokens(model, 1, 11), state)
    with pytest.raises(StateError, match="keep_states"):
        state.rollback(1)  # a plain step keeps no DeltaNet history
    model.forward_step(tokens(model, 3, 12), state, keep_states=True)
    with pytest.raises(StateError, match=r"recorded positions 11\.\.14"):
        state.rollback(4)
    with pytest.raises(StateError):
        state.rollback(-1)
    assert state.length == 14
    state.rollback(3)
    assert state.length == 11


def test_clone_is_independent(model):
    state = model.new_state(64)
    model.forward_step(tokens(model, 12, 13), state)
    copy = state.clone()
    nxt = tokens(model, 4, 14)
    a = decode(model, copy, nxt)
    assert state.length == 12 and copy.length == 16
    assert torch.equal(decode(model, state, nxt), a)


def test_kv_cache_grows_in_chunks_not_per_token(model):
    state = model.new_state(1000)
    layer = model.config.full_attention_layers[0]
    model.forward_step(tokens(model, 5, 15), state)
    cache = state.kv[layer]
    assert cache.capacity == KV_CHUNK
    pointer = cache.k.data_ptr()
    model.forward_step(tokens(model, KV_CHUNK - 10, 16), state)
    decode(model, state, tokens(model, 5, 27))
    assert cache.k.data_ptr() == pointer  # no reallocation while within capacity
    model.forward_step(tokens(model, 1, 17), state)
    assert cache.capacity == 2 * KV_CHUNK and state.length == KV_CHUNK + 1


def test_context_limit(model):
    state = model.new_state(10)
    model.forward_step(tokens(model, 8, 18), state)
    with pytest.raises(ContextLengthError, match="max_len 10"):
        model.forward_step(tokens(model, 3, 19), state)
    assert state.length == 8
    model.forward_step(tokens(model, 2, 20), state)
    assert state.length == 10
    with pytest.raises(ContextLengthError):
        model.mtp_step(tokens(model, 11, 21), torch.zeros(11, model.config.hidden_size), state)


def test_bad_token_ids(model):
    state = model.new_state(10)
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        model.forward_step(torch.tensor([0, -1]), state)
    with pytest.raises(InvalidRequestError, match="dimension"):
        model.forward_step(torch.tensor([[1, 2]]), state)
    with pytest.raises(InvalidRequestError, match="integer"):
        model.forward_step(torch.tensor([1.0]), state)
    assert state.length == 0


def test_mtp_rollback_and_snapshot(model):
    cfg = model.config
    state = model.new_state(32)
    main = model.forward_step(tokens(model, 9, 22), state)
    model.mtp_step(tokens(model, 8, 23), main.hidden[:8], state)
    snap = state.snapshot()
    first = model.mtp_step(tokens(model, 1, 24), main.hidden[8:], state)
    state.rollback_mtp(1)
    assert torch.equal(model.mtp_step(tokens(model, 1, 24), main.hidden[8:], state).logits, first.logits)
    with pytest.raises(StateError):
        state.rollback_mtp(10)
    state.restore(snap)
    assert state.mtp_length == 8 and state.length == 9
    assert torch.equal(model.mtp_step(tokens(model, 1, 24), main.hidden[8:], state).logits, first.logits)
    assert cfg.has_mtp


def test_nbytes(model):
    cfg = model.config
    state = model.new_state(4096)
    itemsize = torch.empty((), dtype=model.dtype).element_size()
    n_lin, n_full = len(cfg.linear_attention_layers), len(cfg.full_attention_layers)
    deltanet = n_lin * (
        cfg.linear_qkv_dim * (cfg.linear_conv_kernel_dim - 1) * itemsize
        + cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
    )
    assert state.nbytes() == deltanet  # nothing allocated for KV yet
    model.forward_step(tokens(model, 300, 25), state)
    per_position = 2 * cfg.num_key_value_heads * cfg.head_dim * itemsize
    kv_capacity = state.kv[cfg.full_attention_layers[0]].capacity
    assert 300 <= kv_capacity <= 2 * 300
    assert state.nbytes() == deltanet + n_full * kv_capacity * per_position
    snap = state.snapshot()  # trimmed to the length; no MTP positions yet
    assert snap.nbytes() == deltanet + n_full * 300 * per_position
    model.forward_step(tokens(model, 4, 26), state, keep_states=True)
    assert state.nbytes() == deltanet * 6 + n_full * kv_capacity * per_position  # 5 recorded states


def test_state_works_inside_and_outside_inference_mode(model):
    """The engine runs steps under torch.inference_mode() and rolls back / restores outside it."""
    state = model.new_state(600)
    with torch.inference_mode():
        model.forward_step(tokens(model, 300, 28), state)  # the KV caches grow in here
        model.forward_step(tokens(model, 4, 29), state, keep_states=True)
    state.rollback(2)
    snap = state.snapshot()
    expected = model.forward_step(tokens(model, 2, 30), state).logits
    with torch.inference_mode():
        state.restore(snap)
        model.forward_step(tokens(model, 1, 31), state, keep_states=True)
    state.rollback(1)
    assert state.length == 302 and not any(c.k.is_inference() for c in state.kv.values())
    torch.testing.assert_close(model.forward_step(tokens(model, 2, 30), state).logits, expected)


def test_state_of_another_dtype_is_refused(model):
    state = model.new_state(8)
    half = Qwen35ForCausalLM(model.config).to(torch.bfloat16)
    with pytest.raises(StateError, match="new_state"):
        half.forward_step(tokens(model, 2, 32), state)
    assert state.length == 0


def test_logits_last_is_the_last_row_of_all(model):
    ids = tokens(model, 40, 40)
    full_state, last_state = model.new_state(64), model.new_state(64)
    full = model.forward_step(ids, full_state)
    last = model.forward_step(ids, last_state, logits="last")
    assert last.logits.shape == (1, model.config.vocab_size) and last.hidden.shape == full.hidden.shape
    assert torch.equal(last.hidden, full.hidden)
    # One row instead of T: only the matmul's blocking differs.
    torch.testing.assert_close(last.logits, full.logits[-1:], rtol=1e-5, atol=1e-5)
    pairs = tokens(model, 39, 41)
    mtp_full = model.mtp_step(pairs, full.hidden[:-1], full_state)
    mtp_last = model.mtp_step(pairs, last.hidden[:-1], last_state, logits="last")
    torch.testing.assert_close(mtp_last.logits, mtp_full.logits[-1:], rtol=1e-5, atol=1e-5)
    assert mtp_last.hidden.shape == (
        39,
        mtp_full.hidden.shape[1],
    )
    with pytest.raises(InvalidRequestError, match="logits must be one of"):
        model.forward_step(ids[:1], full_state, logits="first")
    with pytest.raises(InvalidRequestError, match="logits must be one of"):
        model.mtp_step(ids[:1], full.hidden[:1], full_state, logits="none")
    assert full_state.length == 40 and full_state.mtp_length == 39


def test_light_snapshot_restores_by_truncation(model):
    ids, cont, other = tokens(model, 30, 42), tokens(model, 6, 43), tokens(model, 9, 44)
    state = model.new_state(128)
    main = model.forward_step(ids, state)
    model.mtp_step(ids[1:], main.hidden[:-1], state)
    light, full = state.snapshot(include_kv=False), state.snapshot()
    assert light.light and not full.light
    expected = decode(model, state, cont)
    state.restore(light)
    assert state.length == 30 and state.mtp_length == 29 and state.token_ids == ids.tolist()
    assert torch.equal(decode(model, state, cont), expected)
    state.restore(light)  # restorable again, also after the full snapshot's restore
    state.restore(full)
    assert torch.equal(decode(model, state, cont), expected)
    # Once positions before the snapshot's end hold other tokens, its KV prefix is gone.
    state.restore(model.new_state(128).snapshot(include_kv=False))  # empty: length 0
    assert state.length == 0 and state.token_ids == []
    model.forward_step(other, state)
    assert not state.can_restore(light)
    with pytest.raises(StateError, match="no longer holds"):
        state.restore(light)
    assert state.can_restore(full)  # a full snapshot carries its own KV
    state.restore(full)
    assert torch.equal(decode(model, state, cont), expected)


def test_light_snapshot_bytes_do_not_grow_with_the_context(model):
    state = model.new_state(1024)
    model.forward_step(tokens(model, 20, 45), state)
    short = state.snapshot(include_kv=False)
    model.forward_step(tokens(model, 500, 46), state)
    long = state.snapshot(include_kv=False)
    deltanet = sum(t.numel() * t.element_size() for t in (*state.conv.values(), *state.recurrent.values()))
    assert short.nbytes() == long.nbytes() == deltanet
    kv_bytes = sum(2 * c.k[:, :520].numel() * c.k.element_size() for c in state.kv.values())
    assert state.snapshot().nbytes() == long.nbytes() + kv_bytes  # the full one carries the KV prefix


def test_release_history_frees_the_rollback_records(model):
    state = model.new_state(64)
    model.forward_step(tokens(model, 10, 47), state)
    model.forward_step(tokens(model, 4, 48), state, keep_states=True)
    recorded = state.nbytes()
    state.release_history()
    assert state.nbytes() < recorded
    with pytest.raises(StateError, match="none recorded"):
        state.rollback(1)


def test_token_ids_survive_many_unread_steps_and_rollbacks(model):
    """Token ids are read back lazily: hundreds of one-token steps, rollbacks into unread ones, a snapshot."""
    ids = tokens(model, 300, 49)
    state = model.new_state(512)
    model.forward_step(ids[:20], state)
    for i in range(20, 290):
        model.forward_step(ids[i : i + 1], state)
    model.forward_step(ids[290:], state, keep_states=True)
    state.rollback(4)
    assert state.token_ids == ids[:296].tolist()
    model.forward_step(ids[296:299], state, keep_states=True)
    state.rollback(2)
    snap = state.snapshot(include_kv=False)
    assert snap.token_ids == tuple(ids[:297].tolist())
    assert state.clone().token_ids == state.token_ids
