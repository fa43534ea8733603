"""What the fast prefill's elementwise work moves and launches per layer, without a GPU: the torch forms traced op
by op on the meta device (shapes only), against the bytes the Triton kernels read and write once.

For a piece of `--tokens` of the 27B shapes: a DeltaNet layer's norms, its mixer's elementwise work (the delta
rule itself left out: fla's on the GPU) and the SwiGLU product, then an attention layer's own elementwise work
(its heads' norms and RoPE, its output gate; its norms and SwiGLU are the DeltaNet layer's rows).
An op is counted with the bytes of its tensor inputs and outputs (views and allocations are free; an in-place op
is not a view); GEMMs are listed apart.

    python -m tools.prefill_traffic --tokens 256 8192
"""

from __future__ import annotations

import argparse
import collections
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

ALLOCATIONS = {"empty", "empty_like", "new_empty", "empty_strided"}
GEMMS = {"mm", "addmm", "bmm", "baddbmm", "linear"}


class Traffic(TorchDispatchMode):
    """Counts, per op, the calls and the bytes of tensor inputs and outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes: collections.Counter[str] = collections.Counter()
        self.calls: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        name = str(func.overloadpacket.__name__)
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if name in ALLOCATIONS or (not func._schema.is_mutable and _aliases(outputs, inputs)):
            return out  # a view (a reshape that copies is not one) or an allocation: nothing moves
        self.bytes[name] += sum(t.numel() * t.element_size() for t in (*inputs, *outputs))
        self.calls[name] += 1
        return out

    def split(self) -> tuple[int, int, int, int]:
        """(elementwise bytes, elementwise launches, GEMM operand bytes, GEMMs)."""
        ew = [n for n in self.calls if n not in GEMMS]
        gemm = [n for n in self.calls if n in GEMMS]
        return (
            sum(self.bytes[n] for n in ew),
            sum(self.calls[n] for n in ew),
            sum(self.bytes[n] for n in gemm),
            sum(self.calls[n] for n in gemm),
        )


def _aliases(outputs: list[torch.Tensor], inputs: list[torch.Tensor]) -> bool:
    """Every output shares its storage with an input."""
    storages = {t.untyped_storage()._cdata for t in inputs}
    return bool(outputs) and all(t.untyped_storage()._cdata in storages for t in outputs)


def trace(fn: Callable[[], Any]) -> Traffic:
    counter = Traffic()
    with counter, torch.inference_mode():
        fn()
    return counter


def layer_traffic(tokens: int) -> list[dict[str, Any]]:
    from onestream.kernels.random_model import config_27b
    from onestream.worker.model import Qwen35ForCausalLM
    from onestream.worker.prefill.elementwise import TorchElementwise

    config = config_27b(4)
    with torch.device("meta"):
        model = Qwen35ForCausalLM(config).to(torch.bfloat16)
    layer = next(layer for layer in model.model.layers if not layer.is_full_attention)
    mixer, mlp, ops = layer.linear_attn, layer.mlp, TorchElementwise()
    bf16 = torch.bfloat16
    h = torch.empty(tokens, config.hidden_size, device="meta", dtype=bf16)
    x_proj = torch.empty(tokens, mixer.conv_dim, device="meta", dtype=bf16)
    state = torch.empty(mixer.conv_dim, mixer.kernel - 1, device="meta", dtype=bf16)
    gates_in = torch.empty(tokens, mixer.num_v_heads, device="meta", dtype=bf16)
    core = torch.empty(tokens, mixer.num_v_heads, mixer.head_v_dim, device="meta", dtype=bf16)
    inter = torch.empty(tokens, mlp.gate_proj.out_features, device="meta", dtype=bf16)
    size = 2  # bf16 bytes
    hidden, channels, heads = config.hidden_size, mixer.conv_dim, mixer.num_v_heads
    # What each kernel reads and writes once (triton_kernels.py): inputs, outputs and the conv state's copy.
    fused = {
        "input norm": 2 * tokens * hidden * size,
        "conv + silu": 2 * tokens * channels * size,
        "gates": tokens * heads * (3 * size + 4),
        "gated norm": 3 * core.numel() * size,
        "post norm": 2 * tokens * hidden * size,
        "silu * up": 3 * inter.numel() * size,
    }
    torch_forms = {
        "input norm": lambda: ops.rms_norm(layer.input_layernorm, h),
        "conv + silu": lambda: ops.conv_silu(mixer, x_proj, state),
        "gates": lambda: ops.gates(mixer, gates_in, gates_in),
        "gated norm": lambda: ops.gated_rms_norm(mixer.norm, core, core),
        "post norm": lambda: ops.rms_norm(layer.post_attention_layernorm, h),
        "silu * up": lambda: ops.silu_mul_(inter, inter),
    }
    attention = next(layer for layer in model.model.layers if layer.is_full_attention).self_attn
    d, heads, kv_heads = attention.head_dim, attention.num_heads, attention.num_kv_heads
    qg = torch.empty(1, tokens, 2 * heads * d, device="meta", dtype=bf16)
    kv = torch.empty(1, tokens, kv_heads * d, device="meta", dtype=bf16)
    table = torch.empty(tokens, config.rotary_dim, device="meta", dtype=bf16)
    attn = torch.empty(1, heads, tokens, d, device="meta", dtype=bf16)
    gate = qg.view(1, tokens, heads, 2 * d)[..., d:].reshape(1, tokens, -1)
    # The head kernel reads each row and its rotated dims again, writes the row, and reads the tables per head.
    rows_read = (heads + kv_heads) * (2 * d + 3 * config.rotary_dim)
    fused["attention: q, k norm + rope"] = rows_read * tokens * size
    fused["attention: output gate"] = 3 * tokens * heads * d * size
    torch_forms["attention: q, k norm + rope"] = lambda: ops.attention_heads(
        attention, qg, kv, kv, table, table
    )
    torch_forms["attention: output gate"] = lambda: ops.attention_gate(attention, attn, gate)
    # the conv's kernel is followed by its state's copy; the heads' kernel runs once for q, once for k
    kernel_launches = {name: 2 if name.startswith(("conv", "attention: q")) else 1 for name in fused}
    rows = []
    for name, fn in torch_forms.items():
        moved, launches, _, _ = trace(fn).split()
        rows.append(
            {
                "op": name,
                "torch_bytes": moved,
                "torch_launches": launches,
                "kernel_bytes": fused[name],
                "kernel_launches": kernel_launches[name],
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, nargs="+", default=[256, 8192])
    args = parser.parse_args(argv)
    for tokens in args.tokens:
        rows = layer_traffic(tokens)
        print(f"27B shapes, a piece of {tokens} tokens, per layer (GB; launches):")
        print(f"  {'op':<28} {'torch forms':>12} {'launches':>9} {'kernels':>8} {'launches':>9}")
        deltanet = [r for r in rows if not r["op"].startswith("attention")]
        total = {
            "op": "DeltaNet layer, all",
            **{k: sum(r[k] for r in deltanet) for k in rows[0] if k != "op"},
        }
        for r in [*deltanet, total, *[r for r in rows if r["op"].startswith("attention")]]:
            print(
                f"  {r['op']:<28} {r['torch_bytes'] / 1e9:12.3f} {r['torch_launches']:9d} "
                f"{r['kernel_bytes'] / 1e9:8.3f} {r['kernel_launches']:9d}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
