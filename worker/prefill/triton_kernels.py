"""Triton kernels for the prefill's elementwise work: each reads its inputs once and writes its output once.

In PyTorch each of these is a chain of fp32 passes over a `[T, width]` tensor (a norm is about ten), which at
an 8K-token piece moves several times the bytes of the layer's weights and launches dozens of kernels per layer.
The arithmetic follows the torch forms in `elementwise.py` (fp32, the same roundings to the model dtype); sums and
the transcendental functions may differ in the last fp32 bit, so results agree to a rounding of the output.

The token counts are not specialised on (Triton would compile another variant the first time a piece's length
is a multiple of 16, on a request's path); everything else a kernel is compiled for is fixed by the model, so the
probe at start-up compiles every variant a prompt uses.

On a machine without a GPU the CPU tests run them under Triton's interpreter (`TRITON_INTERPRET=1`, which
tests/conftest.py sets there before Triton is imported), so the same source the GPU compiles is checked.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# torch's softplus default: above it softplus(x) is x (a constexpr, so that the kernels may read it).
SOFTPLUS_THRESHOLD = tl.constexpr(20.0)


@triton.jit(do_not_specialize=["rows"])
def _rms_norm(x_ptr, w_ptr, out_ptr, rows, width, eps, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """out = x * rsqrt(mean(x^2) + eps) * (1 + w), fp32, rows of `width` (ZeroCenteredRMSNorm)."""
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    c = tl.arange(0, BLOCK)
    m = (r < rows)[:, None] & (c < width)[None, :]
    offsets = r.to(tl.int64)[:, None] * width + c[None, :]
    x = tl.load(x_ptr + offsets, mask=m, other=0.0).to(tl.float32)
    inv = tl.math.rsqrt(tl.sum(x * x, axis=1) / width + eps)
    w1 = 1.0 + tl.load(w_ptr + c, mask=c < width, other=0.0).to(tl.float32)
    tl.store(out_ptr + offsets, ((x * inv[:, None]) * w1[None, :]).to(out_ptr.dtype.element_ty), mask=m)


@triton.jit(do_not_specialize=["rows"])
def _gated_rms_norm(x_ptr, z_ptr, w_ptr, out_ptr, rows, width, eps, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """out = (w * norm(x)) * silu(z) (GatedRMSNorm): normalised in fp32, rounded to x's dtype, scaled by the
    weight in that dtype, multiplied by the fp32 gate, rounded again."""
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    c = tl.arange(0, BLOCK)
    m = (r < rows)[:, None] & (c < width)[None, :]
    offsets = r.to(tl.int64)[:, None] * width + c[None, :]
    x = tl.load(x_ptr + offsets, mask=m, other=0.0).to(tl.float32)
    inv = tl.math.rsqrt(tl.sum(x * x, axis=1) / width + eps)
    normed = (x * inv[:, None]).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + c, mask=c < width, other=0.0).to(tl.float32)
    scaled = (w[None, :] * normed).to(out_ptr.dtype.element_ty).to(tl.float32)
    z = tl.load(z_ptr + offsets, mask=m, other=0.0).to(tl.float32)
    gate = z / (1.0 + tl.exp(-z))
    tl.store(out_ptr + offsets, (scaled * gate).to(out_ptr.dtype.element_ty), mask=m)


@triton.jit(do_not_specialize=["tokens"])
def _conv_silu(
    x_ptr,
    state_ptr,
    w_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    tokens,
    channels,
    state_stride,
    w_stride,
    KEYS: tl.constexpr,
    SPAN: tl.constexpr,
    BT: tl.constexpr,
    BC: tl.constexpr,
):
    """silu(x[t] w[SPAN] + sum_j in[t - SPAN + j] w[j]) per channel, in fp32, where `in` is the conv state
    (`[channels, SPAN]`, the last inputs before the piece) followed by x (`[tokens, channels]`); channels
    [0, KEYS) go to q `[tokens, KEYS]`, [KEYS, 2 KEYS) to k, the rest to v, each contiguous (the delta rule's
    kernels would copy column slices of one output). A block of BC channels lies in one of them (BC divides
    KEYS), and only the first block of rows reaches back into the state (BT > SPAN): every other load and store
    is a contiguous row of channels, which the compiler vectorises."""
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    c0 = tl.program_id(1) * BC
    c = c0 + tl.arange(0, BC)
    mc = c < channels
    m = (t < tokens)[:, None] & mc[None, :]
    t64 = t.to(tl.int64)[:, None]
    w_now = tl.load(w_ptr + c * w_stride + SPAN, mask=mc, other=0.0).to(tl.float32)
    acc = tl.load(x_ptr + t64 * channels + c[None, :], mask=m, other=0.0).to(tl.float32) * w_now[None, :]
    for j in tl.static_range(SPAN):
        w_j = tl.load(w_ptr + c * w_stride + j, mask=mc, other=0.0).to(tl.float32)
        if tl.program_id(0) == 0:
            src = t - SPAN + j  # the tap's input position; < 0: in the conv state
            in_x = (src >= 0)[:, None]
            row = tl.maximum(src, 0).to(tl.int64)[:, None]
            from_x = tl.load(x_ptr + row * channels + c[None, :], mask=m & in_x, other=0.0)
            column = tl.minimum(tl.maximum(SPAN + src, 0), SPAN - 1)[:, None]
            from_state = tl.load(state_ptr + c[None, :] * state_stride + column, mask=m & ~in_x, other=0.0)
            tap = tl.where(in_x, from_x, from_state).to(tl.float32)
        else:
            tap = tl.load(x_ptr + (t64 - SPAN + j) * channels + c[None, :], mask=m, other=0.0).to(tl.float32)
        acc += tap * w_j[None, :]
    out = (acc / (1.0 + tl.exp(-acc))).to(q_ptr.dtype.element_ty)
    if c0 < KEYS:
        tl.store(q_ptr + t64 * KEYS + c[None, :], out, mask=m)
    elif c0 < 2 * KEYS:
        tl.store(k_ptr + t64 * KEYS + (c - KEYS)[None, :], out, mask=m)
    else:
        tl.store(v_ptr + t64 * (channels - 2 * KEYS) + (c - 2 * KEYS)[None, :], out, mask=m)


@triton.jit(do_not_specialize=["count"])
def _gates(b_ptr, a_ptr, a_log_ptr, dt_bias_ptr, beta_ptr, g_ptr, count, heads, BLOCK: tl.constexpr):
    """beta = sigmoid(b) in b's dtype; g = -exp(A_log) softplus(a + dt_bias) in fp32; `[T, heads]` each."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < count
    head = i % heads
    b = tl.load(b_ptr + i, mask=m, other=0.0).to(tl.float32)
    tl.store(beta_ptr + i, (1.0 / (1.0 + tl.exp(-b))).to(beta_ptr.dtype.element_ty), mask=m)
    a = tl.load(a_ptr + i, mask=m, other=0.0).to(tl.float32) + tl.load(dt_bias_ptr + head, mask=m).to(
        tl.float32
    )
    softplus = tl.where(a > SOFTPLUS_THRESHOLD, a, tl.log(1.0 + tl.exp(tl.minimum(a, SOFTPLUS_THRESHOLD))))
    decay = -tl.exp(tl.load(a_log_ptr + head, mask=m).to(tl.float32))
    tl.store(g_ptr + i, decay * softplus, mask=m)


@triton.jit(do_not_specialize=["groups"])
def _silu_mul(gate_ptr, up_ptr, groups, BLOCK: tl.constexpr):
    """gate <- silu(gate) * up, in place, each product of the model dtype's values (SwiGLU's roundings), over
    `groups` of 8 elements (a bound the compiler knows is a multiple of 8 lets it load 16 bytes at a time)."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < groups * 8
    g = tl.load(gate_ptr + i, mask=m, other=0.0).to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate_ptr.dtype.element_ty).to(tl.float32)
    up = tl.load(up_ptr + i, mask=m, other=0.0).to(tl.float32)
    tl.store(gate_ptr + i, (silu * up).to(gate_ptr.dtype.element_ty), mask=m)


@triton.jit(do_not_specialize=["tokens"])
def _head_norm_rope(
    x_ptr,
    w_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    tokens,
    token_stride,
    head_stride,
    eps,
    WIDTH: tl.constexpr,
    ROT: tl.constexpr,
    ROWS: tl.constexpr,
):
    """One head's rows of a projection (x[t, h, :WIDTH] at the given strides): ZeroCenteredRMSNorm, rounded to
    the output dtype, then rotate-half RoPE on the first ROT dims with each product and the sum rounded as the
    model dtype's arithmetic rounds them; written to out `[heads, tokens, WIDTH]`. The rotated dims are read
    again as their two halves, so that every load and store is a contiguous run (ROT / 2 a power of two)."""
    h = tl.program_id(1)
    t = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    t64 = t.to(tl.int64)[:, None]
    e = tl.arange(0, WIDTH)
    m = (t < tokens)[:, None]
    row = x_ptr + t64 * token_stride + h * head_stride
    x = tl.load(row + e[None, :], mask=m, other=0.0).to(tl.float32)
    inv = tl.math.rsqrt(tl.sum(x * x, axis=1) / WIDTH + eps)[:, None]
    dtype = out_ptr.dtype.element_ty
    normed = ((x * inv) * (1.0 + tl.load(w_ptr + e).to(tl.float32))[None, :]).to(dtype)
    out = out_ptr + (h * tokens + t64) * WIDTH
    tl.store(out + e[None, :], normed, mask=m & (e >= ROT)[None, :])  # what RoPE leaves alone
    if ROT > 0:
        half = tl.arange(0, ROT // 2)[None, :]
        lo = tl.load(row + half, mask=m, other=0.0).to(tl.float32)
        hi = tl.load(row + ROT // 2 + half, mask=m, other=0.0).to(tl.float32)
        w_lo = 1.0 + tl.load(w_ptr + half).to(tl.float32)
        w_hi = 1.0 + tl.load(w_ptr + ROT // 2 + half).to(tl.float32)
        n_lo = ((lo * inv) * w_lo).to(dtype).to(tl.float32)
        n_hi = ((hi * inv) * w_hi).to(dtype).to(tl.float32)
        table = t64 * ROT + half
        cos_lo = tl.load(cos_ptr + table, mask=m, other=0.0).to(tl.float32)
        cos_hi = tl.load(cos_ptr + table + ROT // 2, mask=m, other=0.0).to(tl.float32)
        sin_lo = tl.load(sin_ptr + table, mask=m, other=0.0).to(tl.float32)
        sin_hi = tl.load(sin_ptr + table + ROT // 2, mask=m, other=0.0).to(tl.float32)
        # x cos + rotate_half(x) sin, rotate_half(x) = (-x_hi, x_lo); each product rounded, then the sum
        out_lo = (n_lo * cos_lo).to(dtype).to(tl.float32) + (-n_hi * sin_lo).to(dtype).to(tl.float32)
        out_hi = (n_hi * cos_hi).to(dtype).to(tl.float32) + (n_lo * sin_hi).to(dtype).to(tl.float32)
        tl.store(out + half, out_lo.to(dtype), mask=m)
        tl.store(out + ROT // 2 + half, out_hi.to(dtype), mask=m)


@triton.jit(do_not_specialize=["tokens"])
def _gated_heads(
    attn_ptr,
    gate_ptr,
    out_ptr,
    tokens,
    attn_head_stride,
    attn_token_stride,
    gate_token_stride,
    gate_head_stride,
    heads,
    WIDTH: tl.constexpr,
    ROWS: tl.constexpr,
):
    """out[t, h * WIDTH + e] = attn[h, t, e] * sigmoid(gate[t, h, e]), the sigmoid and the product each rounded
    to the output dtype (GatedAttention._finish)."""
    h = tl.program_id(1)
    t = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    e = tl.arange(0, WIDTH)
    m = (t < tokens)[:, None]
    t64 = t.to(tl.int64)[:, None]
    a = tl.load(attn_ptr + h * attn_head_stride + t64 * attn_token_stride + e[None, :], mask=m, other=0.0)
    g = tl.load(gate_ptr + t64 * gate_token_stride + h * gate_head_stride + e[None, :], mask=m, other=0.0)
    dtype = out_ptr.dtype.element_ty
    sig = (1.0 / (1.0 + tl.exp(-g.to(tl.float32)))).to(dtype).to(tl.float32)
    tl.store(
        out_ptr + t64 * (heads * WIDTH) + h * WIDTH + e[None, :], (a.to(tl.float32) * sig).to(dtype), mask=m
    )


def _row_tiles(width: int) -> tuple[int, int]:
    """(rows per program, the power-of-two block a row is loaded in): about 4K elements per program."""
    block = triton.next_power_of_2(width)
    return max(1, 4096 // block), block


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """ZeroCenteredRMSNorm over the last dimension of a contiguous `x`."""
    width = x.shape[-1]
    rows = x.numel() // width
    out = torch.empty_like(x)
    per, block = _row_tiles(width)
    _rms_norm[(triton.cdiv(rows, per),)](x, weight, out, rows, width, eps, ROWS=per, BLOCK=block)
    return out


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """GatedRMSNorm over the last dimension of contiguous `x` and `z` of one shape."""
    width = x.shape[-1]
    rows = x.numel() // width
    out = torch.empty_like(x)
    per, block = _row_tiles(width)
    _gated_rms_norm[(triton.cdiv(rows, per),)](x, z, weight, out, rows, width, eps, ROWS=per, BLOCK=block)
    return out


# What the kernels take (elementwise.py gives anything else to the torch forms; Qwen3.5 is always inside).
CONV_ROWS = 32  # rows of tokens per conv program: the conv's window must be shorter


def conv_fits(keys: int, kernel: int) -> bool:
    """The conv kernel's bounds: key channels in blocks of at least 16 (channel_block), a window under CONV_ROWS."""
    return channel_block(keys) >= 16 and kernel - 1 < CONV_ROWS


def silu_mul_fits(count: int) -> bool:
    """The SwiGLU product's kernel loads 8 elements at a time."""
    return count % 8 == 0


def heads_fit(width: int) -> bool:
    """The head kernels load a head in one power-of-two block."""
    return width & (width - 1) == 0


def rotary_fits(rotary: int) -> bool:
    """The norm-and-RoPE kernel loads the rotated dims as two power-of-two halves."""
    half = rotary // 2
    return half & (half - 1) == 0


def channel_block(keys: int) -> int:
    """The conv's channels per program: the largest power of two up to 128 that divides `keys`, so that a block
    lies in one of q, k and v."""
    block = 128
    while keys % block:
        block //= 2
    return block


def conv_silu(
    x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor, keys: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The depthwise causal conv and silu over a piece: x `[T, C]` (contiguous), state `[C, span]` (the inputs
    before the piece), weight `[C, span + 1]` (rows contiguous). Returns q `[T, keys]`, k `[T, keys]` and v
    `[T, C - 2 keys]`, contiguous, in x's dtype; `state` is read, not advanced."""
    tokens, channels = x.shape
    span = weight.shape[1] - 1
    if not conv_fits(keys, span + 1):
        raise ValueError(f"conv_silu does not take a window of {span + 1} with {keys} key channels")
    bt, bc = CONV_ROWS, channel_block(keys)
    q, k = (x.new_empty(tokens, keys) for _ in range(2))
    v = x.new_empty(tokens, channels - 2 * keys)
    grid = (triton.cdiv(tokens, bt), triton.cdiv(channels, bc))
    _conv_silu[grid](
        x,
        state,
        weight,
        q,
        k,
        v,
        tokens,
        channels,
        state.stride(0),
        weight.stride(0),
        KEYS=keys,
        SPAN=span,
        BT=bt,
        BC=bc,
    )
    return q, k, v


def gates(
    b: torch.Tensor, a: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(beta, g) of the delta rule from the contiguous `[T, heads]` projections b and a."""
    beta = torch.empty_like(b)
    g = torch.empty(a.shape, dtype=torch.float32, device=a.device)
    count, block = a.numel(), 1024
    _gates[(triton.cdiv(count, block),)](b, a, a_log, dt_bias, beta, g, count, a.shape[-1], BLOCK=block)
    return beta, g


def silu_mul_(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate <- silu(gate) * up for contiguous tensors of one shape, a multiple of 8 elements; returns gate."""
    count, block = gate.numel(), 1024
    if not silu_mul_fits(count):
        raise ValueError(f"silu_mul_ takes a multiple of 8 elements, got {count}")
    _silu_mul[(triton.cdiv(count, block),)](gate, up, count // 8, BLOCK=block)
    return gate


def head_norm_rope(
    x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """x `[T, heads, D]` (any strides but a unit stride along D): each head's RMSNorm, then partial RoPE with the
    `[T, rot]` tables, as GatedAttention._project; returns `[heads, T, D]` contiguous."""
    tokens, heads, width = x.shape
    if x.stride(2) != 1:
        x = x.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    out = torch.empty(heads, tokens, width, dtype=x.dtype, device=x.device)
    rows = max(1, 2048 // width)
    grid = (triton.cdiv(tokens, rows), heads)
    _head_norm_rope[grid](
        x,
        weight,
        cos,
        sin,
        out,
        tokens,
        x.stride(0),
        x.stride(1),
        eps,
        WIDTH=width,
        ROT=cos.shape[-1],
        ROWS=rows,
    )
    return out


def gated_heads(attn: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """attn `[heads, T, D]` and gate `[T, heads, D]` (any strides but a unit stride along D) -> `[T, heads * D]`:
    attn * sigmoid(gate), heads side by side."""
    heads, tokens, width = attn.shape
    if attn.stride(2) != 1:
        attn = attn.contiguous()
    if gate.stride(2) != 1:
        gate = gate.contiguous()
    out = torch.empty(tokens, heads * width, dtype=attn.dtype, device=attn.device)
    rows = max(1, 2048 // width)
    _gated_heads[(triton.cdiv(tokens, rows), heads)](
        attn,
        gate,
        out,
        tokens,
        attn.stride(0),
        attn.stride(1),
        gate.stride(0),
        gate.stride(1),
        heads,
        WIDTH=width,
        ROWS=rows,
    )
    return out
