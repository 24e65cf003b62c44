"""The fused-plane kernels (kvcx.codecs.planes): exact for every bit pattern, on any thread count, and every
bad argument refused with a message naming it."""
import numpy as np
import pytest

from kvcx.codecs.dtypes import BFLOAT16
from kvcx.codecs.planes import fused_join, fused_split
from kvcx.errors import CodecError


@pytest.mark.parametrize("order,bs,d", [("vec", 32, 64), ("amx", 32, 64), ("amx", 64, 128), ("vec", 6, 10)])
@pytest.mark.parametrize("dtype", [np.uint16, np.uint32])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_every_bit_pattern_round_trips(order, bs, d, dtype, threads):
    rng = np.random.default_rng(bs + d)
    bits = rng.integers(0, np.iinfo(dtype).max, (3, 4 * bs, 2 * 2 * d), dtype=dtype, endpoint=True)
    chunk = bits.view(BFLOAT16 if dtype == np.uint16 else np.float32)     # NaN and Inf patterns included
    k, v = fused_split(chunk, bs, d, order, n_threads=threads)
    assert k.shape == v.shape == (3, 4 * bs, 2 * d)
    back = fused_join(k, v, np.zeros_like(chunk), bs, d, order, n_threads=threads)
    assert np.array_equal(back.view(dtype), bits)
    k2, v2 = fused_split(chunk, bs, d, order, keys=np.empty_like(k), values=np.empty_like(v), n_threads=1)
    assert np.array_equal(k2.view(dtype), k.view(dtype)) and np.array_equal(v2.view(dtype), v.view(dtype))


def test_bad_arguments_are_refused():
    x = np.zeros((2, 64, 256), BFLOAT16)
    cases = [
        (lambda: fused_split(x.astype(np.int16), 32, 64, "vec"), "bfloat16, float16 or float32"),
        (lambda: fused_split(x, 32, 64, "neon"), "order must be one of"),
        (lambda: fused_split(x, 7, 64, "vec"), "even integer"),
        (lambda: fused_split(x, 48, 64, "vec"), "not whole 48-token blocks"),
        (lambda: fused_split(x, 32, 48, "vec"), "heads of 2 \\* 48"),
        (lambda: fused_split(x, 8, 64, "amx"), "multiples of 16"),
        (lambda: fused_split(x[:, :, :128].reshape(2, 64, 128)[:, ::2], 32, 32, "vec"), "C-contiguous"),
        (lambda: fused_split(x, 32, 64, "vec", keys=np.zeros((2, 64, 64), BFLOAT16)), "keys must be"),
        (lambda: fused_split(x.reshape(2, 64, 2, 128), 32, 64, "vec"), "fused plane is"),
        (lambda: fused_join(np.zeros((2, 64, 128), np.float16), np.zeros((2, 64, 128), BFLOAT16), x, 32, 64, "vec"),
         "keys must be"),
    ]
    ro = np.zeros_like(x)
    ro.flags.writeable = False
    cases.append((lambda: fused_join(np.zeros((2, 64, 128), BFLOAT16), np.zeros((2, 64, 128), BFLOAT16), ro, 32,
                                     64, "vec"), "writeable"))
    for fn, match in cases:
        with pytest.raises(CodecError, match=match):
            fn()
