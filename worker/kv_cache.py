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
from typing import TypeVar

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


class Cache:
    """A KV cache of either format: its tensors `[kv_heads, capacity, ...]` (the attributes `FIELDS` names) grow,
    copy and count together; `_allocate` makes them and `write` fills them, each the format's own."""

    FIELDS: tuple[str, ...] = ("k", "v")
    # Counts every allocation or replacement of any cache's tensors: a consumer that holds their addresses (the
    # megakernel's tables) re-reads them only when it moved, instead of comparing every cache's pointers.
    generation = 0

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
        self.kv_heads, self.head_dim, self.max_len, self.dtype = kv_heads, head_dim, max_len, dtype
        self._allocate(min(max_len, capacity), torch.device(device))
        Cache.generation += 1

    def _allocate(self, capacity: int, device: torch.device) -> None:
        """Zeroed tensors for `capacity` positions."""
        raise NotImplementedError

    def _tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(getattr(self, name) for name in self.FIELDS)

    def _set_tensors(self, tensors: tuple[torch.Tensor, ...]) -> None:
        for name, t in zip(self.FIELDS, tensors, strict=True):
            setattr(self, name, t)
        Cache.generation += 1

    def _empty(self, capacity: int) -> Cache:
        """An empty cache of this one's shape and format holding `capacity` positions."""
        device = self._tensors()[0].device
        return type(self)(self.kv_heads, self.head_dim, self.max_len, self.dtype, device, capacity)

    def write(self, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store `k, v [kv_heads, T, head_dim]` at positions `start..start+T`; return the keys and values of
        `[0, start+T)` as attention reads them."""
        raise NotImplementedError

    @property
    def capacity(self) -> int:
        return getattr(self, self.FIELDS[0]).shape[1]

    def reserve(self, needed: int) -> None:
        """Make room for `needed` positions; growth at least doubles, so appends are amortised O(1)."""
        # Checked before the allocation context: a launch reserves every attention layer's cache, and entering
        # the context each time cost the speculative cycle tens of microseconds of host time.
        if needed > self.capacity:
            self._grow(needed)

    @allocates
    def _grow(self, needed: int) -> None:
        """Reallocate for `needed` positions (zeros past the ones held)."""
        if needed > self.max_len:
            raise ContextLengthError(
                f"sequence of {needed} tokens exceeds the state's max_len {self.max_len}"
            )
        capacity = max(needed, 2 * self.capacity, KV_CHUNK)
        capacity = min(self.max_len, -(-capacity // KV_CHUNK) * KV_CHUNK)
        grown = []
        for t in self._tensors():
            new = t.new_zeros(t.shape[0], capacity, *t.shape[2:])
            new[:, : t.shape[1]] = t
            grown.append(new)
        self._set_tensors(tuple(grown))

    @allocates
    def copy_prefix(self, length: int, *, capacity: int | None = None) -> Cache:
        """An independent cache holding positions `[0, length)`."""
        out = self._empty(capacity or length)
        out.load_prefix(self, length)
        return out

    @allocates
    def load_prefix(self, other: Cache, length: int) -> None:
        """Overwrite positions `[0, length)` with `other`'s (a cache of the same format)."""
        self.reserve(length)
        for mine, theirs in zip(self._tensors(), other._tensors(), strict=True):
            mine[:, :length] = theirs[:, :length]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors())


class KVCache(Cache):
    """Keys and values of one attention layer in the model's dtype: `[kv_heads, capacity, head_dim]`, grown
    geometrically up to `max_len`."""

    kv_format = "auto"

    def _allocate(self, capacity: int, device: torch.device) -> None:
        self.k = torch.zeros(self.kv_heads, capacity, self.head_dim, dtype=self.dtype, device=device)
        self.v = torch.zeros_like(self.k)

    def write(self, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store `k, v [kv_heads, T, head_dim]` at positions `start..start+T`; return views of `[0, start+T)`."""
        end = start + k.shape[1]
        self.reserve(end)
        self.k[:, start:end] = k
        self.v[:, start:end] = v
        return self.k[:, :end], self.v[:, :end]


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


class Int8KVCache(Cache):
    """Keys and values of one attention layer as int8 levels `[kv_heads, capacity, head_dim]` with fp32 scales
    `[kv_heads, capacity]` (one per head vector); `write` returns them dequantized to the model's dtype."""

    kv_format = "int8"
    FIELDS = ("k", "v", "k_scale", "v_scale")

    def _allocate(self, capacity: int, device: torch.device) -> None:
        self.k = torch.zeros(self.kv_heads, capacity, self.head_dim, dtype=torch.int8, device=device)
        self.v = torch.zeros_like(self.k)
        self.k_scale = torch.zeros(self.kv_heads, capacity, dtype=torch.float32, device=device)
        self.v_scale = torch.zeros_like(self.k_scale)

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
