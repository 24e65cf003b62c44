"""Shared helpers for kvcx tests."""
import numpy as np

from kvcx.codec import BFLOAT16

DTYPES = [np.float16, np.float32, BFLOAT16]
KV_SHAPES = [(1, 3, 37, 64), (2, 4, 128, 64), (1, 1, 5, 128)]
GENERIC_SHAPES = [(1000,), (7, 24), (3, 1, 9, 16), (1,)]


def random_array(shape, dtype, seed=0, scale=1.0, outlier_channels=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32) * scale
    if outlier_channels and len(shape) >= 2:
        x[..., rng.choice(shape[-1], outlier_channels, replace=False)] *= 8.0
    return x.astype(dtype)


def max_step(x, bits, asym):
    """An upper bound of one quantization step for any group of x."""
    a = np.asarray(x, dtype=np.float32)
    span = float(a.max() - a.min()) if asym else 2.0 * float(np.abs(a).max())
    levels = (2 ** bits - 1) if asym else (2 ** bits - 2)
    return span / levels


def check_roundtrip(codec, x):
    """Encode/decode; shape and dtype kept, every error within half a step (plus FP16 scale rounding)."""
    p = codec.encode(x)
    y = codec.decode(p)
    assert y.shape == x.shape and y.dtype == x.dtype
    err = np.abs(y.astype(np.float32) - x.astype(np.float32))
    bound = 0.5 * max_step(x, codec.bits, codec.asym) * 1.01 + 2e-3 * float(np.abs(x.astype(np.float32)).max())
    if codec.rotate:  # errors are bounded in the rotated space; rotation preserves the L2 norm per token
        bound *= np.sqrt(x.shape[-1])
    assert float(err.max()) <= bound, (float(err.max()), bound)
    return p, y
