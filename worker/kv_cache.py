"""KV caches of the full-attention layers, one per layer of a `SequenceState`, in one of two formats behind one
interface (`write` stores a launch's new keys and values and returns what attention reads):

- `KVCache` ("auto"): keys and values in the model's dtype (bf16 on a GPU), `[kv_heads, capacity, head_dim]`.
- `Int8KVCache` ("int8"): int8 keys and values with one fp32 scale per (head, position) vector: 260 bytes where a
  bf16 head vector of 256 takes 512, for a mean KLD of about 2e-5 nats on the embedded model (docs/benchmarks.md,
  session 26: `tools/kv_cache_kld.py`). A vector is quantized once, where it is written (the largest |x| at 127,
  rounded to nearest), so every later read of it sees the same values.

Both grow geometrically up to `max_len` (appends are amortised O(1)) and copy prefixes for snapshots.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Protocol, TypeVar

import torch

from .errors import ContextLengthError, InvalidRequestError

KV_CHUNK = 256  # KV caches grow by at least this many positions at a time
KV_FORMATS = ("auto", "int8")  # auto: the model's dtype, as vLLM's --kv-cache-dtype says it
DEFAULT_KV_FORMAT = "auto"
INT8_TOP = 127  # the largest |level| of an int8 cache vector

_F = TypeVar("_F", bound=Callable)


@contextlib.contextmanager
def plain_tensors() -> Iterator[None]:
    """Allocate ordinary (non-inference) tensors without autograd, even inside `torch.inference_mode()`.

    Ordinary tensors may be updated in place both inside and outside inference mode; inference tensors
    only inside. State tensors are therefore always ordinary, whatever mode the caller runs the model in.
    """
    with torch.inference_mode(False), torch.no_grad():
        yield


def allocates(fn: _F) -> _F:
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):  # type: ignore[no-untyped-def]
        with plain_tensors():
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def check_kv_format(kv_format: str) -> str:
    """`kv_format`, or InvalidRequestError naming the formats there are."""
    if kv_format not in KV_FORMATS:
        raise InvalidRequestError(
            f"kv cache format must be one of {', '.join(KV_FORMATS)}, got {kv_format!r}"
        )
    return kv_format


def kv_vector_bytes(kv_format: str, head_dim: int, dtype_bytes: int = 2) -> int:
    """Bytes one (head, position) key or value vector takes in a cache of `kv_format`."""
    return head_dim + 4 if check_kv_format(kv_format) == "int8" else head_dim * dtype_bytes


class Cache(Protocol):
    """What a `SequenceState` and the attention layers use of a KV cache."""

    max_len: int

    @property
    def capacity(self) -> int: ...

    def reserve(self, needed: int) -> None: ...

    def write(self, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def copy_prefix(self, length: int, *, capacity: int | None = None) -> Cache: ...

    def load_prefix(self, other: Cache, length: int) -> None: ...

    def nbytes(self) -> int: ...


def _grown(capacity: int, needed: int, max_len: int) -> int:
    """The capacity a cache of `capacity` positions takes to hold `needed` (at least double, whole chunks)."""
    if needed > max_len:
        raise ContextLengthError(f"sequence of {needed} tokens exceeds the state's max_len {max_len}")
    new_cap = max(needed, 2 * capacity, KV_CHUNK)
    return min(max_len, -(-new_cap // KV_CHUNK) * KV_CHUNK)


def _regrow(t: torch.Tensor, capacity: int) -> torch.Tensor:
    """`t` ([heads, positions, ...]) with room for `capacity` positions, its contents kept."""
    new = t.new_zeros(t.shape[0], capacity, *t.shape[2:])
    new[:, : t.shape[1]] = t
    return new


class KVCache:
    """Keys and values of one attention layer in the model's dtype: `[kv_heads, capacity, head_dim]`, grown
    geometrically up to `max_len`."""

    kv_format = "auto"

    @allocates
    def __init__(
        self,
        kv_heads: int,
        head_dim: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device,
        capacity: int = 0,
    ) -> None:
        self.max_len = max_len
        capacity = min(max_len, capacity)
        self.k = torch.zeros(kv_heads, capacity, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)

    @property
    def capacity(self) -> int:
        return self.k.shape[1]

    @allocates
    def reserve(self, needed: int) -> None:
        """Make room for `needed` positions; growth at least doubles, so appends are amortised O(1)."""
        if needed <= self.capacity:
            return
        capacity = _grown(self.capacity, needed, self.max_len)
        self.k, self.v = _regrow(self.k, capacity), _regrow(self.v, capacity)

    def write(self, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store `k, v [kv_heads, T, head_dim]` at positions `start..start+T`; return views of `[0, start+T)`."""
        end = start + k.shape[1]
        self.reserve(end)
        self.k[:, start:end] = k
        self.v[:, start:end] = v
        return self.k[:, :end], self.v[:, :end]

    @allocates
    def copy_prefix(self, length: int, *, capacity: int | None = None) -> KVCache:
        """An independent cache holding positions `[0, length)`."""
        out = KVCache(
            self.k.shape[0], self.k.shape[2], self.max_len, self.k.dtype, self.k.device, capacity or length
        )
        out.k[:, :length] = self.k[:, :length]
        out.v[:, :length] = self.v[:, :length]
        return out

    @allocates
    def load_prefix(self, other: KVCache, length: int) -> None:
        """Overwrite positions `[0, length)` with `other`'s."""
        self.reserve(length)
        self.k[:, :length] = other.k[:, :length]
        self.v[:, :length] = other.v[:, :length]

    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`x [..., head_dim]` as int8 levels and one fp32 scale per vector: the largest |x| maps to 127, levels
    round to nearest (a zero vector: zero levels and scale)."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1) / INT8_TOP
    inverse = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    levels = torch.round(xf * inverse[..., None]).clamp_(-INT8_TOP, INT8_TOP).to(torch.int8)
    return levels, scale


def dequantize_int8(levels: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The values `quantize_int8` stored, in `dtype`."""
    return (levels.float() * scale[..., None]).to(dtype)


class Int8KVCache:
    """Keys and values of one attention layer as int8 levels `[kv_heads, capacity, head_dim]` with fp32 scales
    `[kv_heads, capacity]` (one per head vector); `write` returns them dequantized to the model's dtype."""

    kv_format = "int8"

    @allocates
    def __init__(
        self,
        kv_heads: int,
        head_dim: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device,
        capacity: int = 0,
    ) -> None:
        self.max_len = max_len
        self.dtype = dtype
        capacity = min(max_len, capacity)
        self.k = torch.zeros(kv_heads, capacity, head_dim, dtype=torch.int8, device=device)
        self.v = torch.zeros_like(self.k)
        self.k_scale = torch.zeros(kv_heads, capacity, dtype=torch.float32, device=device)
        self.v_scale = torch.zeros_like(self.k_scale)

    @property
    def capacity(self) -> int:
        return self.k.shape[1]

    def _tensors(self) -> tuple[torch.Tensor, ...]:
        return self.k, self.v, self.k_scale, self.v_scale

    @allocates
    def reserve(self, needed: int) -> None:
        """Make room for `needed` positions; growth at least doubles, so appends are amortised O(1)."""
        if needed <= self.capacity:
            return
        capacity = _grown(self.capacity, needed, self.max_len)
        self.k, self.v, self.k_scale, self.v_scale = (_regrow(t, capacity) for t in self._tensors())

    def write(self, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Quantize and store `k, v [kv_heads, T, head_dim]` at positions `start..start+T`; return `[0, start+T)`
        dequantized (the new positions as later reads will see them)."""
        end = start + k.shape[1]
        self.reserve(end)
        self.k[:, start:end], self.k_scale[:, start:end] = quantize_int8(k)
        self.v[:, start:end], self.v_scale[:, start:end] = quantize_int8(v)
        return (
            dequantize_int8(self.k[:, :end], self.k_scale[:, :end], self.dtype),
            dequantize_int8(self.v[:, :end], self.v_scale[:, :end], self.dtype),
        )

    @allocates
    def copy_prefix(self, length: int, *, capacity: int | None = None) -> Int8KVCache:
        """An independent cache holding positions `[0, length)`."""
        out = Int8KVCache(
            self.k.shape[0], self.k.shape[2], self.max_len, self.dtype, self.k.device, capacity or length
        )
        for mine, theirs in zip(out._tensors(), self._tensors(), strict=True):
            mine[:, :length] = theirs[:, :length]
        return out

    @allocates
    def load_prefix(self, other: Int8KVCache, length: int) -> None:
        """Overwrite positions `[0, length)` with `other`'s."""
        self.reserve(length)
        for mine, theirs in zip(self._tensors(), other._tensors(), strict=True):
            mine[:, :length] = theirs[:, :length]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors())


def new_kv_cache(
    kv_format: str,
    kv_heads: int,
    head_dim: int,
    max_len: int,
    dtype: torch.dtype,
    device: torch.device,
) -> KVCache | Int8KVCache:
    """An empty cache of `kv_format` (KV_FORMATS) for one attention layer."""
    cls = Int8KVCache if check_kv_format(kv_format) == "int8" else KVCache
    return cls(kv_heads, head_dim, max_len, dtype, device)
