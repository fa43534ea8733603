"""The fast prefill of one sequence: the reference model's weights and state, kernels made for long pieces.

Per layer it runs the layer's own projection, norm and MLP modules (cuBLAS GEMMs; a quantized matrix is
dequantized on the device into one reused scratch right before its GEMM, one matrix at a time: quant/scratch.py),
the chunked delta rule for the DeltaNet layers
(`deltanet.py`) and fused causal SDPA for the attention layers (`attention.py`). It writes exactly the
`SequenceState` that `Qwen35ForCausalLM.forward_step` would (KV caches, conv windows, fp32 recurrent states,
lengths), so the reference model and the megakernel continue from it unchanged.
"""

from __future__ import annotations

import contextlib
import os

import torch

from ..errors import InvalidRequestError
from ..layers.decoder import DecoderLayer
from ..model import Qwen35ForCausalLM, StepOutput
from ..quant import QuantizedLinear
from ..quant.scratch import DequantScratch
from ..quant.weight import _QuantizedModule
from ..state import SequenceState
from .attention import attention_prefill, sdpa_choice
from .deltanet import DEFAULT_CHUNK, DeltaRuleKernel, deltanet_prefill
from .elementwise import elementwise_for

PIECE_ENV = "ONESTREAM_PREFILL_TOKENS"
# Tokens per call on a GPU: the pieces' GEMMs are long enough to run near the matrix peak well before
# this, and a piece's activations (the MLP's [T, intermediate] pair above all) stay a few GB.
DEFAULT_PIECE_TOKENS = 8192
# Elements of the scratch when the output head is the only quantized matrix (its slices' size otherwise is
# the largest layer matrix's): 64 Mi, 128 MiB of bf16.
HEAD_SLICE_ELEMENTS = 1 << 26


def _elements(module: torch.nn.Module) -> int:
    rows, cols = module.shape  # type: ignore[misc]
    return int(rows) * int(cols)


def operator_piece_tokens() -> int | None:
    """The operator's prefill piece ($ONESTREAM_PREFILL_TOKENS), or None when unset: it wins over the piece
    the engine chooses for its card (memory.choose_prefill_piece)."""
    raw = os.environ.get(PIECE_ENV)
    if raw is None:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise InvalidRequestError(f"${PIECE_ENV} must be a positive integer, got {raw!r}")
    return value


def piece_tokens_from_env(default: int = DEFAULT_PIECE_TOKENS) -> int:
    """The operator's piece, else `default` (a back end's piece until its engine sizes it for the card)."""
    operator = operator_piece_tokens()
    return default if operator is None else operator


class FastPrefill:
    """`__call__(input_ids, state)` runs prompt tokens like `model.forward_step(..., logits="last")`;
    `mtp(input_ids, hidden, state)` runs MTP pairs like `model.mtp_step(..., logits="last")`."""

    def __init__(
        self,
        model: Qwen35ForCausalLM,
        *,
        deltanet: str | None = None,
        sdpa: str | None = None,
        chunk: int = DEFAULT_CHUNK,
        dequant: str | None = None,
        elementwise: str | None = None,
    ) -> None:
        """`dequant`: the quantized weights' decoder (triton, torch or auto; default $ONESTREAM_PREFILL_DEQUANT);
        `elementwise`: the form of the work around the GEMMs, norms to SwiGLU (elementwise.py; triton, torch or
        auto, default $ONESTREAM_PREFILL_ELEMENTWISE)."""
        self.model = model
        c = model.config
        heads = (
            c.linear_num_key_heads,
            c.linear_num_value_heads,
            c.linear_key_head_dim,
            c.linear_value_head_dim,
        )
        self.delta_rule = DeltaRuleKernel(model.device, deltanet, chunk, heads)
        layers = model.model.layers
        mixer = next((layer.linear_attn for layer in layers if not layer.is_full_attention), None)
        attention = next((layer.self_attn for layer in layers if layer.is_full_attention), None)
        self.elementwise = elementwise_for(
            model.device, layers[0].input_layernorm, mixer, attention, elementwise
        )
        self.sdpa = sdpa_choice(sdpa)
        self.dequant = dequant
        self.scratch = self._make_scratch(dequant)

    def weights_moved(self) -> None:
        """Size the scratch again after quantized weights handed their bytes over (the megakernel's runner took
        them, kernels/quant_weights.py): those no longer go through it, and a scratch nobody uses is dropped."""
        self.scratch = self._make_scratch(self.dequant)

    def _make_scratch(self, decoder: str | None) -> DequantScratch | None:
        """A scratch as large as the largest quantized matrix but the output head's (that one, a vocabulary of
        rows for the last token alone, goes through it in slices), or None for a model without any."""
        model = self.model
        head = self._head()
        sizes = [
            _elements(m)
            for m in model.modules()
            if isinstance(m, QuantizedLinear) and m.dequantized is None and m.source is None and m is not head
        ]
        if (
            isinstance(head, _QuantizedModule)
            and head.dequantized is None
            and head.source is None
            and not sizes
        ):
            sizes.append(min(_elements(head), HEAD_SLICE_ELEMENTS))
        if not sizes:
            return None
        return DequantScratch(max(sizes), model.dtype, model.device, decoder)

    def _head(self) -> torch.nn.Module:
        model = self.model
        return model.model.embed_tokens if model.config.tie_word_embeddings else model.lm_head

    def _last_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The model's `_step_logits(hidden, "last")`; a quantized head multiplies through the scratch rather
        than dequantizing its whole vocabulary at once."""
        head = self._head()
        quantized = isinstance(head, _QuantizedModule) and head.dequantized is None
        if self.scratch is not None and quantized and head.source is None:  # (handed over: no GGUF bytes)
            weight = head.quantized
            if self.scratch.accepts(weight, head.compute_dtype):
                return self.scratch.linear(weight, hidden[-1:]).float()
        return self.model._step_logits(hidden, "last")

    def _dequantizing(self) -> contextlib.AbstractContextManager[object]:
        return self.scratch.active() if self.scratch is not None else contextlib.nullcontext()

    @property
    def description(self) -> str:
        probe = self.delta_rule.probe_errors
        checked = f", probe error {max(probe):.1e}" if probe else ""
        text = (
            f"delta rule {self.delta_rule.name} (chunk {self.delta_rule.chunk}{checked}), SDPA {self.sdpa}, "
            f"elementwise {self.elementwise.name}"
        )
        return text if self.scratch is None else f"{text}, {self.scratch.description}"

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, state: SequenceState) -> StepOutput:
        with self._dequantizing():
            return self._prefill(input_ids, state)

    def _prefill(self, input_ids: torch.Tensor, state: SequenceState) -> StepOutput:
        model = self.model
        model._check_ids(input_ids, 1)
        model._check_state(state)
        t = input_ids.shape[0]
        start = state.check_room(t)
        h = model.model.embed_tokens(input_ids)
        cos, sin = model.rotary(torch.arange(start, start + t, device=h.device), h.dtype)
        ops = self.elementwise
        for i, layer in enumerate(model.model.layers):
            x = ops.rms_norm(layer.input_layernorm, h)
            if layer.is_full_attention:
                h = h + attention_prefill(layer.self_attn, x, cos, sin, state.kv[i], start, ops, self.sdpa)
            else:
                h = h + deltanet_prefill(
                    layer.linear_attn, x, state.conv[i], state.recurrent[i], self.delta_rule, ops
                )
            del x
            h = self._mlp_residual(layer, h)
        hidden = ops.rms_norm(model.model.norm, h)
        state.advance(input_ids)
        state.history = None  # as a step without keep_states: nothing to roll back into
        return StepOutput(self._last_logits(hidden), hidden)

    def _mlp_residual(self, layer: DecoderLayer, h: torch.Tensor) -> torch.Tensor:
        """`layer._mlp_residual(h)` with the elementwise work in `self.elementwise`'s form."""
        mlp, ops = layer.mlp, self.elementwise
        x = ops.rms_norm(layer.post_attention_layernorm, h)
        return h + mlp.down_proj(ops.silu_mul_(mlp.gate_proj(x), mlp.up_proj(x)))

    @torch.inference_mode()
    def mtp(self, input_ids: torch.Tensor, hidden: torch.Tensor, state: SequenceState) -> StepOutput:
        with self._dequantizing():
            return self._mtp(input_ids, hidden, state)

    def _mtp(self, input_ids: torch.Tensor, hidden: torch.Tensor, state: SequenceState) -> StepOutput:
        model = self.model
        mtp = model._require_mtp()
        model._check_ids(input_ids, 1)
        model._check_state(state)
        t = input_ids.shape[0]
        if hidden.shape != (t, model.config.hidden_size):
            raise InvalidRequestError(
                f"hidden must have shape ({t}, {model.config.hidden_size}), got {tuple(hidden.shape)}"
            )
        start = state.check_room(t, mtp=True)
        x = mtp.fuse(model.model.embed_tokens(input_ids), hidden.to(model.dtype))
        cos, sin = model.rotary(torch.arange(start, start + t, device=x.device), x.dtype)
        assert state.mtp_kv is not None
        layer = mtp.layer
        ops = self.elementwise
        h = x + attention_prefill(
            layer.self_attn,
            ops.rms_norm(layer.input_layernorm, x),
            cos,
            sin,
            state.mtp_kv,
            start,
            ops,
            self.sdpa,
        )
        out = ops.rms_norm(mtp.norm, self._mlp_residual(layer, h))
        state.mtp_length += t
        return StepOutput(self._last_logits(out), out)
