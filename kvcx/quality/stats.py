"""The statistics of a retrieval gate: accuracy with its interval, and a paired test against the exact cache.

A retrieval cell is a count of prompts answered out of ``n``; the exact cache and a compressed setting answer the
same prompts, so they are compared prompt by prompt (paired), not as two independent proportions:

- :func:`wilson_interval`: the Wilson score interval of a proportion (Wilson 1927), which keeps its coverage at
  small ``n`` and at 0 % or 100 % where the normal ("Wald") interval collapses to a point;
- :func:`mcnemar_below`: McNemar's exact test, one-sided: of the prompts where the two caches disagree, the
  exact cache alone answered ``b`` and the setting alone ``c``; under "the setting is no worse" each disagreement
  is a fair coin, so the p-value is P(Binomial(b + c, 1/2) >= b);
- :func:`holm`: Holm's step-down adjustment of several cells' p-values, so that a setting checked at many
  lengths and tasks is failed with a family-wise error of at most ``alpha``, not ``alpha`` per cell.

Pure Python (``math`` only): no SciPy needed, and the same figures on every machine.
"""
from __future__ import annotations

import math
from typing import List, Sequence, Tuple

ALPHA = 0.05
Z95 = 1.959963984540054


def wilson_interval(correct: int, n: int, z: float = Z95) -> Tuple[float, float]:
    """The Wilson score interval (two-sided, 95 % by default) of ``correct`` successes in ``n`` trials."""
    if n <= 0:
        return 0.0, 1.0
    p = correct / n
    denom = 1.0 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def binomial_tail(k: int, n: int) -> float:
    """P(X >= k) for X ~ Binomial(n, 1/2), exactly (a sum of binomial coefficients over 2^n)."""
    if k <= 0:
        return 1.0
    if k > n:
        return 0.0
    return math.fsum(math.comb(n, i) for i in range(k, n + 1)) / 2.0 ** n


def mcnemar_below(exact: Sequence[bool], setting: Sequence[bool]) -> Tuple[float, int, int]:
    """(one-sided p-value, b, c) of McNemar's exact test that ``setting`` answers fewer prompts than ``exact`` on
    the same prompts: ``b`` prompts only the exact cache answered, ``c`` only the setting. A small p-value says
    the setting is below the exact cache by more than chance."""
    if len(exact) != len(setting):
        raise ValueError(f"paired outcomes of different lengths: {len(exact)} vs {len(setting)}")
    b = sum(1 for e, s in zip(exact, setting) if e and not s)
    c = sum(1 for e, s in zip(exact, setting) if s and not e)
    return binomial_tail(b, b + c), b, c


def holm(p_values: Sequence[float]) -> List[float]:
    """Holm-adjusted p-values (same order as given): a cell is significant at family-wise ``alpha`` when its
    adjusted p-value is below ``alpha``."""
    m = len(p_values)
    order = sorted(range(m), key=lambda i: p_values[i])
    adjusted, running = [0.0] * m, 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p_values[i]))
        adjusted[i] = running
    return adjusted
