"""Scale searches: for each group of weights, the scale (and offset) whose rounded grid fits it best.

A group `x [N, n]` is stored either symmetrically, `x ~ d q` with integer q in [qmin, qmax], or affinely,
`x ~ s q + b` with q in [0, qmax]. The plain choice maps the group's extremes onto the grid's ends; it is
good for Gaussian-like groups but wastes levels when one value stands out. So each search tries divisors
around the grid's size (the plain one among them), rounds the group to each, refits the scale (and offset)
by least squares for that rounding, and keeps whichever candidate has the smallest squared error *after*
the scale is stored (`store`: fp16 rounding for a block's own scale, identity for the sub-block scales a
K-quant quantizes again later) and the group rounded to the nearest level of the stored grid.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

Store = Callable[[torch.Tensor], torch.Tensor]

# Offsets of the divisor around the grid's size: -1 (coarser, no clipping) .. +1 (finer, clips the extreme).
# Steps of 0.2: steps of 0.1 cost twice the time for under 0.1% less error on Gaussian weights.
DIVISOR_OFFSETS = tuple(k / 5 for k in range(-5, 6))


def identity(values: torch.Tensor) -> torch.Tensor:
    return values


def safe_reciprocal(values: torch.Tensor) -> torch.Tensor:
    """1 / values, and 0 where values is 0 (an all-zero group rounds to q = 0)."""
    nonzero = values != 0
    return torch.where(nonzero, 1.0 / torch.where(nonzero, values, 1.0), 0.0)


def nearest_symmetric(x: torch.Tensor, d: torch.Tensor, qmin: int, qmax: int) -> torch.Tensor:
    """The nearest grid levels (as floats) of `x [..., n]` for scales `d [...]`."""
    return (x * safe_reciprocal(d).unsqueeze(-1)).round().clamp(qmin, qmax)


def nearest_affine(x: torch.Tensor, s: torch.Tensor, b: torch.Tensor, qmax: int) -> torch.Tensor:
    """The nearest levels in [0, qmax] of `x [..., n]` for `x ~ s q + b`."""
    return ((x - b.unsqueeze(-1)) * safe_reciprocal(s).unsqueeze(-1)).round().clamp(0, qmax)


def squared_error(
    x: torch.Tensor, s: torch.Tensor, q: torch.Tensor, b: torch.Tensor | None = None
) -> torch.Tensor:
    """Sum over the last dimension of (x - (s q + b))^2, computed in the order the dequantizers use."""
    values = s.unsqueeze(-1) * q
    if b is not None:
        values = values + b.unsqueeze(-1)
    return (x - values).square().sum(-1)


def keep_better(
    best: tuple[torch.Tensor, ...], err: torch.Tensor, candidate: tuple[torch.Tensor, ...]
) -> tuple[torch.Tensor, ...]:
    """Per group, `(err, *candidate)` where `err` is below `best[0]`, else `best`."""
    better = err < best[0]
    return (
        torch.where(better, err, best[0]),
        *(torch.where(better, c, o) for c, o in zip(candidate, best[1:], strict=True)),
    )


def _finish(
    store: Store,
    plain: tuple[torch.Tensor, ...],
    ranked: tuple[torch.Tensor, ...],
    error: Callable[..., torch.Tensor],
) -> tuple[torch.Tensor, ...]:
    """Of the plain choice and the ranking's winner, the one with the smallest error once stored and rounded.

    Stored as they are (identity), the winner cannot lose: the plain divisor is among the candidates and a
    least-squares refit and a new rounding only lower its error."""
    if store is identity:
        return ranked
    best: tuple[torch.Tensor, ...] = (torch.full_like(plain[0], float("inf")), *plain)
    for candidate in (plain, ranked):
        stored = tuple(store(value) for value in candidate)
        best = keep_better(best, error(*stored), stored)
    return best[1:]


def fit_symmetric(x: torch.Tensor, qmin: int, qmax: int, store: Store) -> torch.Tensor:
    """Per group of `x [..., n]`: the stored scale d minimising sum (x - d q)^2 over the candidates.

    Divisors are `qmin - offset` applied to the group's signed extreme, so the extreme lands near the grid's
    longer end (a negative d flips the grid: either sign of extreme uses the extra level). Candidates are
    ranked by the closed-form error of their least-squares refit; the winner is then compared, stored and
    rounded again, with the plain divisor `qmin`, so the result is never worse than the plain choice.
    """
    peak = x.gather(-1, x.abs().argmax(-1, keepdim=True)).squeeze(-1)
    sum_xx = x.square().sum(-1)
    best: tuple[torch.Tensor, ...] = (torch.full_like(peak, float("inf")), peak / qmin)
    for offset in DIVISOR_OFFSETS:
        q = nearest_symmetric(x, peak / (qmin - offset), qmin, qmax)
        sum_qq, sum_xq = q.square().sum(-1), (x * q).sum(-1)
        solvable = sum_qq > 0
        sum_qq = torch.where(solvable, sum_qq, 1.0)
        err = torch.where(solvable, sum_xx - sum_xq.square() / sum_qq, sum_xx)
        best = keep_better(best, err, (torch.where(solvable, sum_xq / sum_qq, 0.0),))
    (d,) = _finish(
        store, (peak / qmin,), best[1:], lambda d: squared_error(x, d, nearest_symmetric(x, d, qmin, qmax))
    )
    return d


def fit_affine(
    x: torch.Tensor, qmax: int, store: Store, *, nonpositive_offset: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per group of `x [..., n]`: stored (s >= 0, b) minimising sum (x - (s q + b))^2 over the candidates.

    With `nonpositive_offset` (the K-quants, whose offset is minus an unsigned min) b is kept <= 0. Ranked
    and finished as `fit_symmetric`; the plain choice maps [min, max] onto [0, qmax].
    """
    lo = x.amin(-1)
    if nonpositive_offset:
        lo = lo.clamp(max=0)
    span = x.amax(-1) - lo
    n = x.shape[-1]
    sum_x, sum_xx = x.sum(-1), x.square().sum(-1)
    plain_s = span / qmax
    best: tuple[torch.Tensor, ...] = (torch.full_like(lo, float("inf")), plain_s, lo)
    for offset in DIVISOR_OFFSETS:
        q = nearest_affine(x, span / (qmax + offset), lo, qmax)
        sum_q, sum_qq, sum_xq = q.sum(-1), q.square().sum(-1), (x * q).sum(-1)
        det = n * sum_qq - sum_q.square()
        solvable = det > 0
        det = torch.where(solvable, det, 1.0)
        s = (n * sum_xq - sum_q * sum_x) / det
        b = (sum_qq * sum_x - sum_q * sum_xq) / det
        if nonpositive_offset:
            through_zero = b > 0  # refit with b = 0
            s = torch.where(through_zero, sum_xq / sum_qq.clamp(min=1), s)
            b = torch.where(through_zero, 0.0, b)
        usable = solvable & (s > 0)
        s, b = torch.where(usable, s, plain_s), torch.where(usable, b, lo)
        err = (
            sum_xx - 2 * s * sum_xq - 2 * b * sum_x + s.square() * sum_qq + 2 * s * b * sum_q + n * b.square()
        )
        best = keep_better(best, torch.where(usable, err, float("inf")), (s, b))
    s, b = _finish(
        store, (plain_s, lo), best[1:], lambda s, b: squared_error(x, s, nearest_affine(x, s, b, qmax), b)
    )
    return s, b
