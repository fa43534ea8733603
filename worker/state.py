"""Explicit per-sequence decoding state of the Qwen3.5 model, with snapshots and rollback.

One `SequenceState` holds everything the model needs to continue one sequence:
- a KV cache per full-attention layer (and one for the MTP layer), preallocated in chunks so that decode
  does not reallocate per token, in the model's dtype or as int8 (`worker/kv_cache.py`);
- per Gated DeltaNet layer, the causal-conv window (the last `kernel - 1` inputs, model dtype) and the fp32
  recurrent state `[Hv, dk, dv]`;
- the main length (`length`), the MTP length (`mtp_length`) and the token ids the state has consumed.

KV caches roll back by truncation. DeltaNet state cannot be truncated, so a `keep_states=True` step records
the state before and after each of its tokens (`rollback` to any of those positions is a copy); any other
position needs a `snapshot()`. A light snapshot (`include_kv=False`) holds only the DeltaNet states and the
lengths, O(layers x state) bytes instead of O(context): it restores by truncating the KV caches, so it is
valid while the state still holds the snapshot's tokens as a prefix.

The consumed token ids are read back to the host lazily (`token_ids`), so that decoding on an accelerator
does not synchronise once per step to record them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import ModelConfig
from .errors import ContextLengthError, StateError
from .kv_cache import DEFAULT_KV_FORMAT, KV_CHUNK, Cache, KVCache, allocates, check_kv_format, new_kv_cache

__all__ = [
    "KV_CHUNK",
    "DeltaNetHistory",
    "KVCache",
    "SequenceState",
    "StateError",
    "StateSnapshot",
    "deltanet_stacks",
]

MAX_UNREAD_PIECES = 256  # token-id tensors not yet read back before they are concatenated into one


def deltanet_stacks(
    config: ModelConfig, dtype: torch.dtype, device: torch.device | str, entries: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Zeroed conv windows (`dtype`) and fp32 recurrent states of every DeltaNet layer, one stack per kind:
    `[layers, ...]`, or `[layers, entries, ...]` for a history's records."""
    layers = (len(config.linear_attention_layers),) + ((entries,) if entries is not None else ())
    conv = (config.linear_qkv_dim, config.linear_conv_kernel_dim - 1)
    rec = (config.linear_num_value_heads, config.linear_key_head_dim, config.linear_value_head_dim)
    return (
        torch.zeros((*layers, *conv), dtype=dtype, device=device),
        torch.zeros((*layers, *rec), dtype=torch.float32, device=device),
    )


@dataclass
class DeltaNetHistory:
    """DeltaNet states recorded by a `keep_states=True` step: entry j is the state at position `start + j`.

    The records of all layers are two stacks, `[layers, n, ...]`, one row per DeltaNet layer in the order of the
    state's `conv`: a rollback to entry j is then one copy of each stack's `[:, j]` into the state's own stacks,
    not a copy per layer (host time on the speculative cycle's critical path). `conv` and `recurrent` are the
    per-layer views of those rows."""

    start: int
    conv_stack: torch.Tensor  # [layers, n, C, kernel-1]
    recurrent_stack: torch.Tensor  # [layers, n, Hv, dk, dv] fp32
    layers: tuple[int, ...]
    # Entries still reachable (None: all n). A rollback lowers it rather than re-slicing every layer's
    # records, which would cost host time on the speculative cycle's critical path.
    entries: int | None = None

    @property
    def conv(self) -> dict[int, torch.Tensor]:
        """Layer -> its row of the conv stack, [n, C, kernel-1] (cut when asked: a verify makes a history)."""
        return dict(zip(self.layers, self.conv_stack.unbind(0), strict=True))

    @property
    def recurrent(self) -> dict[int, torch.Tensor]:
        """Layer -> its row of the recurrent stack, [n, Hv, dk, dv] fp32."""
        return dict(zip(self.layers, self.recurrent_stack.unbind(0), strict=True))

    def clone(self) -> DeltaNetHistory:
        return DeltaNetHistory(
            self.start, self.conv_stack.clone(), self.recurrent_stack.clone(), self.layers, self.entries
        )

    @property
    def end(self) -> int:
        """The last position recorded."""
        if not self.layers:
            return self.start
        n = self.conv_stack.shape[1]
        return self.start + (n if self.entries is None else min(n, self.entries)) - 1

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.conv_stack, self.recurrent_stack))


@dataclass
class StateSnapshot:
    """A frozen copy of a `SequenceState` (trimmed to its length); `SequenceState.restore` copies it back.

    A light snapshot has no KV caches (`kv is None`): restoring it truncates the state's own caches."""

    owner_layout: tuple
    length: int
    mtp_length: int
    token_ids: tuple[int, ...]
    kv: dict[int, Cache] | None
    conv_stack: torch.Tensor  # [layers, C, kernel-1], as the state's
    recurrent_stack: torch.Tensor  # [layers, Hv, dk, dv] fp32
    mtp_kv: Cache | None

    @property
    def light(self) -> bool:
        return self.kv is None

    def nbytes(self) -> int:
        """Device bytes of its tensors (the token ids are a host tuple and not counted)."""
        total = sum(c.nbytes() for c in (self.kv or {}).values())
        total += sum(t.numel() * t.element_size() for t in (self.conv_stack, self.recurrent_stack))
        return total + (self.mtp_kv.nbytes() if self.mtp_kv is not None else 0)


class SequenceState:
    """The decoding state of one sequence. Build it with `Qwen35ForCausalLM.new_state(max_len)`."""

    @allocates
    def __init__(
        self,
        config: ModelConfig,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device | str,
        kv_format: str = DEFAULT_KV_FORMAT,
    ) -> None:
        if max_len < 1:
            raise StateError(f"max_len must be positive, got {max_len}")
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:  # compare equal to the model's `cuda:N`
            device = torch.device("cuda", torch.cuda.current_device())
        self.config = config
        self.max_len = max_len
        self.dtype = dtype
        self.device = device
        self.kv_format = check_kv_format(kv_format)
        self.length = 0
        self.mtp_length = 0
        self._tokens: list[int] = []  # consumed token ids already on the host
        self._unread: list[torch.Tensor] = []  # token-id tensors consumed after those, not read back yet
        kv_shape = (config.num_key_value_heads, config.head_dim)
        self.kv: dict[int, Cache] = {
            i: new_kv_cache(kv_format, *kv_shape, max_len, dtype, device)
            for i in config.full_attention_layers
        }
        # Every DeltaNet layer's state is a row of one stack per kind, so that a rollback copies two tensors.
        self._conv_stack, self._rec_stack = deltanet_stacks(config, dtype, device)
        self._unstack()
        self.mtp_kv: Cache | None = (
            new_kv_cache(kv_format, *kv_shape, max_len, dtype, device) if config.has_mtp else None
        )
        self.history: DeltaNetHistory | None = None

    # ---- bookkeeping used by the model ---------------------------------------------------------------
    def check_room(self, n_tokens: int, *, mtp: bool = False) -> int:
        """Raise `ContextLengthError` unless `n_tokens` more fit; return the start position."""
        start = self.mtp_length if mtp else self.length
        if start + n_tokens > self.max_len:
            what = "MTP positions" if mtp else "tokens"
            raise ContextLengthError(f"{start} + {n_tokens} {what} exceed the state's max_len {self.max_len}")
        return start

    def advance(self, input_ids: torch.Tensor) -> None:
        """Record that the model consumed `input_ids [T]` (called by the model after a step).

        The ids are kept as tensors (the caller must not modify them in place afterwards) and read back when
        `token_ids` is next read, so that recording them on an accelerator costs no synchronisation."""
        self.length += input_ids.shape[0]
        self._unread.append(input_ids)
        if len(self._unread) >= MAX_UNREAD_PIECES:
            self._unread = [torch.cat(self._unread)]

    @property
    def token_ids(self) -> list[int]:
        """The token ids this state has consumed, positions 0..length-1 (do not modify the list)."""
        if self._unread:
            self._tokens.extend(torch.cat(self._unread).tolist())
            self._unread = []
        return self._tokens

    def _truncate_tokens(self, length: int) -> None:
        """Forget the token ids from `length` on, without reading back the ones that stay unread."""
        if length <= len(self._tokens):
            del self._tokens[length:]
            self._unread = []
            return
        keep, pieces = length - len(self._tokens), []
        for piece in self._unread:
            if keep <= 0:
                break
            pieces.append(piece[:keep])
            keep -= piece.shape[0]
        self._unread = pieces

    def _layout(self) -> tuple:
        return (self.config, self.dtype, self.device, self.kv_format)

    def _unstack(self) -> None:
        """`conv` and `recurrent`: layer -> its row of the stacks (views, written in place by the model)."""
        layers = self.config.linear_attention_layers
        self.conv: dict[int, torch.Tensor] = dict(zip(layers, self._conv_stack.unbind(0), strict=True))
        self.recurrent: dict[int, torch.Tensor] = dict(zip(layers, self._rec_stack.unbind(0), strict=True))

    # ---- public operations ---------------------------------------------------------------------------
    @allocates
    def rollback(self, n_tokens: int) -> None:
        """Forget the last `n_tokens` main-model tokens.

        KV caches truncate; DeltaNet states are copied from the last `keep_states=True` step's record, which
        must cover the target position (otherwise restore a snapshot instead). The MTP state is independent:
        use `rollback_mtp`.
        """
        if not 0 <= n_tokens <= self.length:
            raise StateError(f"cannot roll back {n_tokens} tokens of a state holding {self.length}")
        if n_tokens == 0:
            return
        target = self.length - n_tokens
        if self.conv:
            hist = self.history
            if hist is None or not hist.start <= target <= hist.end:
                reach = "none recorded" if hist is None else f"recorded positions {hist.start}..{hist.end}"
                raise StateError(
                    f"cannot roll back to position {target}: DeltaNet states are only kept by the last "
                    f"keep_states=True step ({reach}); restore a snapshot instead"
                )
            j = target - hist.start
            if hist.layers != tuple(self.conv):
                raise StateError("the recorded DeltaNet states are not this state's layers")
            self._conv_stack.copy_(hist.conv_stack[:, j])
            self._rec_stack.copy_(hist.recurrent_stack[:, j])
            # Positions after the target are gone; earlier recorded ones stay reachable.
            hist.entries = j + 1
        self.length = target
        self._truncate_tokens(target)

    def rollback_mtp(self, n_tokens: int) -> None:
        """Forget the last `n_tokens` MTP positions (its KV cache truncates)."""
        if not 0 <= n_tokens <= self.mtp_length:
            raise StateError(
                f"cannot roll back {n_tokens} MTP positions of a state holding {self.mtp_length}"
            )
        self.mtp_length -= n_tokens

    def release_history(self) -> None:
        """Free the DeltaNet states the last `keep_states=True` step recorded (rollback into it then fails)."""
        self.history = None

    @allocates
    def snapshot(self, *, include_kv: bool = True) -> StateSnapshot:
        """A copy of everything needed to come back to this exact point later (see `restore`).

        `include_kv=False` makes a light snapshot: DeltaNet states and lengths only. It can be restored while
        this state still holds the snapshot's tokens as a prefix (the KV caches are then truncated)."""
        kv = mtp_kv = None
        if include_kv:
            kv = {i: c.copy_prefix(self.length) for i, c in self.kv.items()}
            mtp_kv = self.mtp_kv.copy_prefix(self.mtp_length) if self.mtp_kv is not None else None
        return StateSnapshot(
            owner_layout=self._layout(),
            length=self.length,
            mtp_length=self.mtp_length,
            token_ids=tuple(self.token_ids),
            kv=kv,
            conv_stack=self._conv_stack.clone(),
            recurrent_stack=self._rec_stack.clone(),
            mtp_kv=mtp_kv,
        )

    def can_restore(self, snap: StateSnapshot) -> bool:
        """Whether `restore(snap)` would succeed: a full snapshot of this layout always can; a light one
        while the state still holds its tokens (and MTP positions) as a prefix."""
        if snap.owner_layout != self._layout() or max(snap.length, snap.mtp_length) > self.max_len:
            return False
        if not snap.light:
            return True
        if snap.length > self.length or snap.mtp_length > self.mtp_length:
            return False
        return tuple(self.token_ids[: snap.length]) == snap.token_ids

    @allocates
    def restore(self, snap: StateSnapshot) -> None:
        """Return to the point `snap` was taken at (the snapshot stays valid for further restores)."""
        if snap.owner_layout != self._layout():
            raise StateError(
                "snapshot was taken from a state of another model, dtype, device or KV cache format"
            )
        if snap.length > self.max_len or snap.mtp_length > self.max_len:
            raise StateError(
                f"snapshot of {snap.length} tokens does not fit this state's max_len {self.max_len}"
            )
        if snap.light and not self.can_restore(snap):
            raise StateError(
                f"light snapshot at {snap.length} tokens ({snap.mtp_length} MTP positions) cannot be restored: "
                f"the state (length {self.length}, {self.mtp_length} MTP positions) no longer holds its "
                "tokens as a prefix"
            )
        if snap.kv is not None:
            for i, c in self.kv.items():
                c.load_prefix(snap.kv[i], snap.length)
        self._conv_stack.copy_(snap.conv_stack)
        self._rec_stack.copy_(snap.recurrent_stack)
        if self.mtp_kv is not None and snap.mtp_kv is not None:
            self.mtp_kv.load_prefix(snap.mtp_kv, snap.mtp_length)
        self.length = snap.length
        self.mtp_length = snap.mtp_length
        if snap.light:
            self._truncate_tokens(snap.length)
        else:
            self._tokens, self._unread = list(snap.token_ids), []
        self.history = None

    @allocates
    def clone(self) -> SequenceState:
        """An independent deep copy (same capacity, same recorded DeltaNet history)."""
        out = SequenceState.__new__(SequenceState)
        out.config, out.max_len, out.dtype, out.device = self.config, self.max_len, self.dtype, self.device
        out.kv_format = self.kv_format
        out.length, out.mtp_length = self.length, self.mtp_length
        out._tokens, out._unread = list(self.token_ids), []
        out.kv = {i: c.copy_prefix(self.length, capacity=c.capacity) for i, c in self.kv.items()}
        out._conv_stack, out._rec_stack = self._conv_stack.clone(), self._rec_stack.clone()
        out._unstack()
        out.mtp_kv = (
            self.mtp_kv.copy_prefix(self.mtp_length, capacity=self.mtp_kv.capacity)
            if self.mtp_kv is not None
            else None
        )
        out.history = self.history.clone() if self.history is not None else None
        return out

    def nbytes(self) -> int:
        """Bytes of device memory this state's tensors hold (allocated KV capacity included)."""
        total = sum(c.nbytes() for c in self.kv.values())
        total += sum(t.numel() * t.element_size() for t in (*self.conv.values(), *self.recurrent.values()))
        total += self.mtp_kv.nbytes() if self.mtp_kv is not None else 0
        return total + (self.history.nbytes() if self.history is not None else 0)

    def __repr__(self) -> str:
        return (
            f"SequenceState(length={self.length}, mtp_length={self.mtp_length}, max_len={self.max_len}, "
            f"dtype={self.dtype}, device={self.device}, kv_format={self.kv_format}, nbytes={self.nbytes()})"
        )
