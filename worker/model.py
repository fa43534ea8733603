"""The Qwen3.5 text model (reference implementation in PyTorch) with its MTP head.

Parameter names match transformers' text-only `Qwen3_5ForCausalLM` (`model.…`, `lm_head.weight` when untied)
plus `mtp.…`. Three ways to run it:
- `forward_step` / `mtp_step`: one sequence, incremental, with an explicit `SequenceState` (serving);
- `forward` / `mtp_forward`: stateless, batched, differentiable (training, teacher-forced evaluation).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .errors import InvalidRequestError, StateError, UnsupportedModelError
from .kv_cache import DEFAULT_KV_FORMAT
from .layers.attention import RotaryEmbedding
from .layers.decoder import DecoderLayer
from .layers.deltanet import GatedDeltaNet
from .layers.mtp import MTPHead
from .layers.norms import GatedRMSNorm, ZeroCenteredRMSNorm
from .quant.weight import linear_in_slabs
from .state import DeltaNetHistory, SequenceState, deltanet_stacks

INIT_STD = 0.02  # transformers' initializer_range default
LOGITS_CHOICES = ("all", "last")


class StepOutput(NamedTuple):
    """What a model step returns, whichever back end ran it (`backend.Backend`)."""

    logits: torch.Tensor  # [T, V] fp32, or [1, V] (the last row) when asked for logits="last"
    hidden: torch.Tensor  # [T, H] after the final norm (main model) or after mtp.norm (MTP head)


class TextModel(nn.Module):
    """The `model.` prefix of checkpoints: embeddings, decoder layers, final norm."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(config, kind) for kind in config.layer_types])
        self.norm = ZeroCenteredRMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class Qwen35ForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = TextModel(config)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.has_mtp:
            self.mtp = MTPHead(config)
        self.rotary = RotaryEmbedding(config)
        self.init_weights()

    # ---- parameters ----------------------------------------------------------------------------------
    @torch.no_grad()
    def init_weights(self, std: float = INIT_STD) -> None:
        """transformers-style random init: normal(0, std) matrices, zero-centred norms at 0, gated norms at 1."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding, nn.Conv1d)):
                module.weight.normal_(0.0, std)
            elif isinstance(module, ZeroCenteredRMSNorm):
                module.weight.zero_()
            elif isinstance(module, GatedRMSNorm):
                module.weight.fill_(1.0)
            elif isinstance(module, GatedDeltaNet):
                module.dt_bias.fill_(1.0)
                module.A_log.copy_(torch.empty_like(module.A_log).uniform_(0.01, 16).log())

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """`[V, H]`: `lm_head.weight`, or the embedding matrix when tied."""
        return self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype (the final norm's: the embedding's weight may be block-quantized)."""
        return self.model.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.norm.weight.device

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.model.embed_tokens if self.config.tie_word_embeddings else self.lm_head
        out = linear_in_slabs(head, hidden)  # a quantized head: dequantized a slab of rows at a time
        return (F.linear(hidden, self.lm_head_weight) if out is None else out).float()

    def _step_logits(self, hidden: torch.Tensor, rows: str) -> torch.Tensor:
        """Logits of every row, or of the last one only: a 512-token chunk of a 248k vocabulary would
        otherwise make 0.5 GB of fp32 logits that a prefill throws away."""
        return self._logits(hidden[-1:] if rows == "last" else hidden)

    @staticmethod
    def _check_logits_option(logits: str) -> None:
        if logits not in LOGITS_CHOICES:
            raise InvalidRequestError(f"logits must be one of {LOGITS_CHOICES}, got {logits!r}")

    def _require_mtp(self) -> MTPHead:
        if not self.config.has_mtp:
            raise UnsupportedModelError("this model has no MTP head (config mtp_num_hidden_layers=0)")
        return self.mtp

    def _check_ids(self, input_ids: torch.Tensor, ndim: int) -> None:
        if not isinstance(input_ids, torch.Tensor) or input_ids.dtype not in (torch.int64, torch.int32):
            raise InvalidRequestError(f"input_ids must be an integer tensor, got {type(input_ids).__name__}")
        if input_ids.ndim != ndim or input_ids.shape[-1] == 0:
            raise InvalidRequestError(
                f"input_ids must have {ndim} dimension(s) and at least one token, got shape {tuple(input_ids.shape)}"
            )
        if input_ids.device.type == "cpu":  # on an accelerator this check would cost a sync
            lo, hi = int(input_ids.min()), int(input_ids.max())
            if lo < 0 or hi >= self.config.vocab_size:
                bad = lo if lo < 0 else hi
                raise InvalidRequestError(
                    f"input_ids: token id {bad} is outside the vocabulary [0, {self.config.vocab_size})"
                )

    def _check_state(self, state: SequenceState) -> None:
        if state.config != self.config or state.dtype != self.dtype or state.device != self.device:
            raise StateError(
                f"state ({state.dtype} on {state.device}) was not made by this model's new_state "
                f"({self.dtype} on {self.device})"
            )

    # ---- one sequence, incremental -------------------------------------------------------------------
    def new_state(
        self, max_len: int, device: torch.device | str | None = None, kv_format: str = DEFAULT_KV_FORMAT
    ) -> SequenceState:
        """An empty state for up to `max_len` tokens, in the model's dtype, on `device` (default: the model's),
        with KV caches of `kv_format` (worker/kv_cache.py)."""
        return SequenceState(
            self.config, max_len, self.dtype, self.device if device is None else device, kv_format
        )

    @torch.no_grad()
    def forward_step(
        self,
        input_ids: torch.Tensor,
        state: SequenceState,
        *,
        keep_states: bool = False,
        logits: str = "all",
    ) -> StepOutput:
        """Run tokens `input_ids [T]` of one sequence at positions `state.length…` and advance the state.

        T == 1 uses the recurrent DeltaNet form, T > 1 the chunked form continuing from the state. With
        `keep_states`, the DeltaNet states at each of the positions `state.length … state.length + T` are
        recorded so that `state.rollback(n)` for n <= T is a copy (those steps use the recurrent form).
        `logits="last"` returns the logits of the last token only (`[1, V]`); `hidden` always has T rows.
        The state keeps a reference to `input_ids` (its token ids are read back lazily, not per step).
        """
        self._check_ids(input_ids, 1)
        self._check_state(state)
        self._check_logits_option(logits)
        t = input_ids.shape[0]
        start = state.check_room(t)
        h = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary(torch.arange(start, start + t, device=h.device), h.dtype)
        layers = tuple(state.conv)
        if keep_states:  # entry 0: the state before the step; entry j: after its j-th token
            conv_record, rec_record = deltanet_stacks(self.config, state.dtype, state.device, t + 1)
        for i, layer in enumerate(self.model.layers):
            if layer.is_full_attention:
                h = layer.step_attention(h, cos, sin, state.kv[i], start)
                continue
            conv, rec = state.conv[i], state.recurrent[i]
            if keep_states:
                row = layers.index(i)
                conv_record[row, 0], rec_record[row, 0] = conv, rec
            h, history = layer.step_deltanet(h, conv, rec, keep_states)
            if keep_states and history is not None:
                conv_record[row, 1:], rec_record[row, 1:] = history
        hidden = self.model.norm(h)
        state.advance(input_ids)
        state.history = DeltaNetHistory(start, conv_record, rec_record, layers) if keep_states else None
        return StepOutput(self._step_logits(hidden, logits), hidden)

    @torch.no_grad()
    def mtp_step(
        self, input_ids: torch.Tensor, hidden: torch.Tensor, state: SequenceState, *, logits: str = "all"
    ) -> StepOutput:
        """MTP head over `T` pairs at MTP positions `state.mtp_length…`: pair j is token `input_ids[j]` (= t[p+1])
        with `hidden[j]` (= H[p], the main model's post-norm hidden, or the previous MTP output when drafting).
        Returns the draft logits (all rows, or the last with `logits="last"`) and the MTP layer's normed
        output; advances `state.mtp_length` by T."""
        mtp = self._require_mtp()
        self._check_ids(input_ids, 1)
        self._check_state(state)
        self._check_logits_option(logits)
        t = input_ids.shape[0]
        if hidden.shape != (t, self.config.hidden_size):
            raise InvalidRequestError(
                f"hidden must have shape ({t}, {self.config.hidden_size}), got {tuple(hidden.shape)}"
            )
        start = state.check_room(t, mtp=True)
        x = mtp.fuse(self.model.embed_tokens(input_ids), hidden.to(self.dtype))
        cos, sin = self.rotary(torch.arange(start, start + t, device=x.device), x.dtype)
        assert state.mtp_kv is not None
        out = mtp.norm(mtp.layer.step_attention(x, cos, sin, state.mtp_kv, start))
        state.mtp_length += t
        return StepOutput(self._step_logits(out, logits), out)

    # ---- stateless, batched, differentiable ----------------------------------------------------------
    def forward(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`input_ids [B, T]` from position 0 -> (logits `[B, T, V]` fp32, post-norm hidden `[B, T, H]`)."""
        self._check_ids(input_ids, 2)
        h = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary(torch.arange(input_ids.shape[1], device=h.device), h.dtype)
        for layer in self.model.layers:
            h = layer(h, cos, sin)
        hidden = self.model.norm(h)
        return self._logits(hidden), hidden

    def mtp_forward(self, input_ids: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """MTP head over whole sequences: position p pairs `input_ids[:, p]` (= t[p+1], the caller shifts) with
        `hidden[:, p]` (= H[p]), causal attention from position 0. Returns (logits fp32, normed output)."""
        mtp = self._require_mtp()
        self._check_ids(input_ids, 2)
        if hidden.shape != (*input_ids.shape, self.config.hidden_size):
            raise InvalidRequestError(
                f"hidden must have shape {(*input_ids.shape, self.config.hidden_size)}, got {tuple(hidden.shape)}"
            )
        x = mtp.fuse(self.model.embed_tokens(input_ids), hidden.to(self.dtype))
        cos, sin = self.rotary(torch.arange(input_ids.shape[1], device=x.device), x.dtype)
        out = mtp.norm(mtp.layer(x, cos, sin))
        return self._logits(out), out
