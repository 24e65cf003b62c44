"""Quality metrics of a reconstruction: RMSE, relative RMSE, SNR, cosine, max error.

RMSE is absolute (in the tensor's units); ``relative_rmse`` (RMSE / RMS of the original)
and SNR are scale-free and read the same on any model.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np

from kvcx.codecs.cpu import core as _core
from kvcx.codecs.dtypes import check_float, kernel_dtype, raw
from kvcx.codecs.runtime import resolve_threads
from kvcx.errors import CodecError


@dataclass
class ErrorStats:
    """Sums from which RMSE / SNR / cosine / max error follow; add them across tensors."""

    n: int = 0
    sum_xx: float = 0.0
    sum_ee: float = 0.0
    sum_yy: float = 0.0
    sum_xy: float = 0.0
    max_error: float = 0.0

    def __iadd__(self, other: "ErrorStats") -> "ErrorStats":
        self.n += other.n
        self.sum_xx += other.sum_xx
        self.sum_ee += other.sum_ee
        self.sum_yy += other.sum_yy
        self.sum_xy += other.sum_xy
        self.max_error = max(self.max_error, other.max_error)
        return self

    @property
    def rmse(self) -> float:
        return math.sqrt(self.sum_ee / self.n) if self.n else 0.0

    @property
    def relative_rmse(self) -> float:
        """RMSE divided by the original's RMS (scale-free; 10**(-SNR/20))."""
        if self.sum_ee == 0.0:
            return 0.0
        if self.sum_xx == 0.0:
            return math.inf
        return math.sqrt(self.sum_ee / self.sum_xx)

    @property
    def snr_db(self) -> float:
        if self.sum_ee == 0.0:
            return math.inf
        if self.sum_xx == 0.0:
            return -math.inf
        return 10.0 * math.log10(self.sum_xx / self.sum_ee)

    @property
    def cosine_similarity(self) -> float:
        if self.sum_xx == 0.0 and self.sum_yy == 0.0:
            return 1.0
        if self.sum_xx == 0.0 or self.sum_yy == 0.0:
            return 0.0
        return self.sum_xy / math.sqrt(self.sum_xx * self.sum_yy)

    def as_dict(self) -> dict:
        return {"rmse": self.rmse, "relative_rmse": self.relative_rmse, "snr_db": self.snr_db,
                "cosine_similarity": self.cosine_similarity, "max_error": self.max_error}


def error_stats(original, reconstructed, name: str = "tensor", n_threads: Optional[int] = None) -> ErrorStats:
    """Parallel float64 reductions over two same-shape float arrays (thread-count independent)."""
    a = check_float(original, name)
    b = check_float(reconstructed, name)
    if a.shape != b.shape:
        raise CodecError(f"tensor {name!r}: shapes differ ({list(a.shape)} vs {list(b.shape)})")
    n = a.size
    if n == 0:
        return ErrorStats()
    chunk = _core.METRICS_CHUNK
    partials = np.empty(((n + chunk - 1) // chunk, _core.METRICS_FIELDS), dtype=np.float64)
    res = np.empty(_core.METRICS_FIELDS, dtype=np.float64)
    _core.metrics(raw(a), kernel_dtype(a.dtype), raw(b), kernel_dtype(b.dtype), n, partials, res,
                  resolve_threads(n_threads))
    if res[5]:
        raise CodecError(f"tensor {name!r} contains NaN/Inf values; metrics need finite inputs")
    return ErrorStats(n=int(n), sum_xx=float(res[0]), sum_ee=float(res[1]), sum_yy=float(res[2]),
                      sum_xy=float(res[3]), max_error=float(res[4]))


def quality_metrics(original, reconstructed, n_threads: Optional[int] = None) -> dict:
    """RMSE, relative RMSE, SNR (dB), cosine similarity and max abs error of ``reconstructed`` vs ``original``."""
    return error_stats(original, reconstructed, n_threads=n_threads).as_dict()


# ----------------------------------------------------------------------------
# the reference design's verdict on absolute RMSE / SNR / cosine
# ----------------------------------------------------------------------------

# the reference design's thresholds (absolute RMSE: calibrated on TinyLlama's cache scale)
RMSE_THRESHOLD = 0.10
SNR_THRESHOLD_DB = 18.0
COSINE_THRESHOLD = 0.99


@dataclass
class Thresholds:
    rmse: float = RMSE_THRESHOLD
    snr_db: float = SNR_THRESHOLD_DB
    cosine: float = COSINE_THRESHOLD


def quality_level(rmse: float, snr_db: float) -> str:
    """The reference design's level on absolute RMSE and SNR: EXCELLENT (RMSE<0.01, SNR>40 dB),
    GOOD (<0.05, >30), ACCEPTABLE (<0.10, >18), POOR otherwise. Absolute RMSE depends on the
    model's cache scale; read ``relative_rmse`` / SNR (scale-free) and perplexity first."""
    if rmse < 0.01 and snr_db > 40:
        return "EXCELLENT"
    if rmse < 0.05 and snr_db > 30:
        return "GOOD"
    if rmse < 0.10 and snr_db > 18:
        return "ACCEPTABLE"
    return "POOR"


def check_thresholds(stats: ErrorStats, thresholds: Thresholds) -> list:
    """The thresholds ``stats`` misses, as readable strings (empty when it meets them all)."""
    v = []
    snr_ok, cos_ok = stats.snr_db > thresholds.snr_db, stats.cosine_similarity > thresholds.cosine
    if not stats.rmse < thresholds.rmse:
        why = ""
        if snr_ok and cos_ok:   # the scale-free measures pass: say what the absolute bound is and what to use
            rms = stats.rmse / stats.relative_rmse if stats.relative_rmse > 0 else float("nan")
            why = (f" (an absolute bound, set on TinyLlama's cache scale; this cache's values have RMS {rms:.3g}, and "
                   f"its relative RMSE {stats.relative_rmse:.4f}, SNR {stats.snr_db:.1f} dB and cosine "
                   f"{stats.cosine_similarity:.4f} meet their thresholds: raise --max-rmse for this model's scale, "
                   f"or judge it by perplexity with `kvcx validate`)")
        v.append(f"RMSE {stats.rmse:.4f} >= {thresholds.rmse}{why}")
    if not snr_ok:
        v.append(f"SNR {stats.snr_db:.2f} dB <= {thresholds.snr_db} dB")
    if not cos_ok:
        v.append(f"cosine {stats.cosine_similarity:.5f} <= {thresholds.cosine}")
    return v


def json_safe(obj):
    """Replace non-finite floats (JSON has none) with None, recursively."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj

