"""The retrieval gate's statistics against values computed independently (textbook cases, and SciPy's where it is
installed)."""
import math
import random

import pytest

from kvcx.quality import stats


def test_wilson_interval_known_values():
    # Wilson (1927) / Newcombe (1998), table I: 0/10, 1/10, 5/10, 10/10 at 95 %
    for (k, n), (lo, hi) in {(0, 10): (0.0, 0.2775), (1, 10): (0.0179, 0.4042), (5, 10): (0.2366, 0.7634),
                             (10, 10): (0.7225, 1.0)}.items():
        got = stats.wilson_interval(k, n)
        assert got[0] == pytest.approx(lo, abs=1e-4) and got[1] == pytest.approx(hi, abs=1e-4), (k, n, got)
    assert stats.wilson_interval(0, 0) == (0.0, 1.0)
    lo, hi = stats.wilson_interval(18, 20)
    assert lo < 0.9 < hi and 0.0 < lo and hi < 1.0


def test_mcnemar_exact_one_sided():
    exact = [True] * 5 + [False] * 3 + [True] * 12
    # 5 prompts only the exact cache answers, none only the setting: p = 1/2^5
    p, b, c = stats.mcnemar_below(exact, [False] * 5 + [False] * 3 + [True] * 12)
    assert (b, c) == (5, 0) and p == pytest.approx(1 / 32)
    # no disagreement: nothing to test
    assert stats.mcnemar_below(exact, exact) == (1.0, 0, 0)
    # the setting better: never significant below
    p, b, c = stats.mcnemar_below([False] * 4, [True] * 4)
    assert (b, c) == (0, 4) and p == 1.0
    # 6 vs 2: P(X >= 6), X ~ Binomial(8, 1/2) = (28 + 8 + 1) / 256
    p, _, _ = stats.mcnemar_below([True] * 6 + [False] * 2, [False] * 6 + [True] * 2)
    assert p == pytest.approx(37 / 256)
    with pytest.raises(ValueError, match="different lengths"):
        stats.mcnemar_below([True], [True, False])


def test_binomial_tail_matches_scipy_where_installed():
    try:
        import scipy.stats as scipy_stats
    except ImportError:
        scipy_stats = None
    rng = random.Random(0)
    for _ in range(50):
        n = rng.randint(1, 60)
        k = rng.randint(0, n)
        want = sum(math.comb(n, i) for i in range(k, n + 1)) / 2 ** n
        assert stats.binomial_tail(k, n) == pytest.approx(want, rel=1e-12)
        if scipy_stats is not None:
            assert stats.binomial_tail(k, n) == pytest.approx(scipy_stats.binom.sf(k - 1, n, 0.5), rel=1e-9)


def test_holm_step_down():
    # Holm (1979): sorted p 0.01, 0.02, 0.03, 0.04 over 4 -> 0.04, 0.06, 0.06, 0.06 (monotone)
    assert stats.holm([0.04, 0.01, 0.03, 0.02]) == pytest.approx([0.06, 0.04, 0.06, 0.06])
    assert stats.holm([0.5]) == [0.5]
    assert stats.holm([0.6, 0.7]) == [1.0, 1.0]
    assert stats.holm([]) == []
