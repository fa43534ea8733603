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
DIVISOR_OFFSETS = tuple(k / 10 for k in range(-10, 11))


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


def _keep_better(
    best: tuple[torch.Tensor, ...], err: torch.Tensor, candidate: tuple[torch.Tensor, ...]
) -> tuple[torch.Tensor, ...]:
    better = err < best[0]
    return (
        torch.where(better, err, best[0]),
        *(torch.where(better, c, o) for c, o in zip(candidate, best[1:], strict=True)),
    )


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
        best = _keep_better(best, err, (torch.where(solvable, sum_xq / sum_qq, 0.0),))
    return _stored_best(x, store, (peak / qmin, best[1]), lambda d: nearest_symmetric(x, d, qmin, qmax))


def _stored_best(
    x: torch.Tensor,
    store: Store,
    scales: tuple[torch.Tensor, ...],
    levels: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """The stored scale (of `scales`, per group) with the smallest error after rounding to its grid."""
    best: tuple[torch.Tensor, ...] = (torch.full_like(scales[0], float("inf")), scales[0])
    for scale in scales:
        stored = store(scale)
        best = _keep_better(best, squared_error(x, stored, levels(stored)), (stored,))
    return best[1]


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
        best = _keep_better(best, torch.where(usable, err, float("inf")), (s, b))
    final: tuple[torch.Tensor, ...] = (torch.full_like(lo, float("inf")), plain_s, lo)
    for s, b in ((plain_s, lo), (best[1], best[2])):
        s, b = store(s), store(b)
        final = _keep_better(final, squared_error(x, s, nearest_affine(x, s, b, qmax), b), (s, b))
    return final[1], final[2]
