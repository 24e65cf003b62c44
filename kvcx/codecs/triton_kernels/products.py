"""The products of the fused decode attention's tiles (:mod:`kvcx.codecs.triton_kernels.attention`): codes times
the other operand in each product mode (``DOT``: FP32 sums, TF32 passes, int8 on the integer tensor cores in three
pieces of a fixed point), and the fast mode's code conversion to FP16 (the magic-number trick, in PTX on a GPU).
"""
import triton
import triton.language as tl


@triton.jit
def _mm(a, b, acc, DOT: tl.constexpr):
    """acc + a [M, K] @ b [K, N] in FP32: broadcast sums (``DOT`` empty) or ``tl.dot`` at that input precision
    ("tf32x2" and "int8x3" take "tf32x3" here: both operands are split), summed into ``acc`` [M, N] by the
    products themselves (tl.dot's accumulator: no separate additions)."""
    if DOT == "tf32x2" or DOT == "int8x3":
        out = tl.dot(a, b, acc, input_precision="tf32x3")
    elif DOT != "":
        out = tl.dot(a, b, acc, input_precision=DOT)
    else:
        out = acc + tl.sum(a[:, :, None] * b[None, :, :], axis=1)
    return out   # one return: Triton traces what follows a return in a constexpr branch too


@triton.jit
def _mmc(a, c, acc, DOT: tl.constexpr):
    """acc + a [M, K] (FP32) @ (c - 8) [K, N], c the codes (0..15), as :func:`_streams` gives them for ``DOT``
    (centred floats, or 16 (c - 8) as int8 for "int8x3"), as :func:`_mm`. "tf32x2": a split in its TF32 bits
    and the rest, two TF32 products (FP32's accuracy: c needs no split), the second summing into the first;
    "tf32": one product (a rounded to TF32); "int8x3": :func:`_mm_int8x3`."""
    if DOT == "int8x3":
        out = _mm_int8x3(a, c, acc)
    elif DOT == "tf32x2":
        hi = (a.to(tl.int32, bitcast=True) & -8192).to(tl.float32, bitcast=True)
        out = tl.dot(a - hi, c, tl.dot(hi, c, acc, input_precision="tf32"), input_precision="tf32")
    else:
        out = _mm(a, c, acc, DOT)
    return out


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _absmax(a, axis: tl.constexpr = 1):
    """The largest magnitude of ``a`` along ``axis`` (each row's by default), NaN where it holds one (tl.max of
    floats skips NaN): the largest of |a|'s bits as integers, which for floats of sign + are in their order, every
    NaN above +inf above every finite (the CPU kernels' kvcx_absmax_bits). One integer max a pair, as a float max;
    a NaN-keeping float max would be a reduction with a combine function of its own, which Triton's interpreter
    runs element by element in Python (a tenth of a second a tile)."""
    return tl.max(a.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis).to(tl.float32, bitcast=True)


@triton.jit
def _unit(amax, TOP: tl.constexpr = 20):
    """(1 / u, u) for rows whose largest magnitude is ``amax``: u the power of two with amax <= 2**TOP u < 2 amax
    (from the exponent's bits: no division), u NaN where amax is not finite (so are the products then: a NaN in
    the query or the weights gives NaN, not a finite result of its bits). TOP 20: :func:`_fixed`'s 21-bit fixed
    point; 15: FP16's range (65,504 > 2**15: the scaled rows fit, and keep FP16's 11 bits down to 2**-14 of it)."""
    e = tl.maximum((amax.to(tl.int32, bitcast=True) + 0x7FFFFF) >> 23, TOP + 1)   # 2**(e - 127) >= amax
    inv = ((254 + TOP - e) << 23).to(tl.float32, bitcast=True)                     # 2**(TOP - (e - 127))
    return inv, ((e - TOP) << 23).to(tl.float32, bitcast=True) + (amax - amax)


@triton.jit
def _fixed(a, inv):
    """The rows of ``a`` as a fixed point, x = round(a * inv) (|x| <= 2**20), in three int8 pieces x = x0 * 2**14 +
    x1 * 2**7 + x2 (x0 signed, x1 and x2 0..127): rounded by the bits of x + 1.5 * 2**23 (nearest,
    ties to even), the pieces being the low bits of those bits (the offset 2**22 is a multiple of 2**14)."""
    xb = (a * inv[:, None] + 12582912.0).to(tl.int32, bitcast=True)
    return (xb >> 14).to(tl.int8), ((xb >> 7) & 127).to(tl.int8), (xb & 127).to(tl.int8)


@triton.jit
def _dot3(x0, x1, x2, c):
    """x @ (c - 8) in int32, exact, for x in :func:`_fixed`'s pieces and c as :func:`_streams` gives it for
    "int8x3" (16 (c - 8)): the three products are multiples of 16 (the last is shifted down exactly), and every
    term fits for K <= 128 (|x0 16 (c - 8)| sums to 2**20 there, |x (c - 8)| to 2**30: two such sums, the keys'
    streams, fit for K <= 64, head dim 128)."""
    return tl.dot(x0, c, out_dtype=tl.int32) * 1024 + tl.dot(x1, c, out_dtype=tl.int32) * 8 + \
        (tl.dot(x2, c, out_dtype=tl.int32) >> 4)


@triton.jit
def _mm_int8x3(a, c, acc):
    """acc + a @ (c - 8) on the integer tensor cores (c as :func:`_streams` gives it, K <= 128): each row of ``a``
    a 21-bit fixed point of its largest magnitude (:func:`_fixed`), three int8 products summed exactly in int32
    (:func:`_dot3`), then one conversion to FP32 and a scaling. Error: the rounding of x, 2**-21 of the row's
    largest |a| a term, 2**-20 of it at most (the scale is a power of two)."""
    inv, unit = _unit(_absmax(a))
    x0, x1, x2 = _fixed(a, inv)
    return acc + _dot3(x0, x1, x2, c).to(tl.float32) * unit[:, None]


# FP16 magic numbers: 0x6400 is 1024.0, whose last mantissa bit is worth 1, so 0x6400 | n is 1024 + n for a nibble n
# (0..15) and 0x6400 | 16 n is 1024 + 16 n: the centred code n - 8 is (1024 + n) - 1032, or (1024 + 16 n) / 16 - 72,
# exact in FP16
_F16_CODES_ASM = tl.constexpr("""{
    .reg .b32 t, u, m, s, c;
    prmt.b32 t, $4, 0, 0x3120;
    shr.b32 u, t, 8;
    lop3.b32 $0, t, 0x000F000F, 0x64006400, 0xEA;
    lop3.b32 $1, u, 0x000F000F, 0x64006400, 0xEA;
    lop3.b32 $2, t, 0x00F000F0, 0x64006400, 0xEA;
    lop3.b32 $3, u, 0x00F000F0, 0x64006400, 0xEA;
    mov.b32 m, 0x64086408;
    mov.b32 s, 0x2C002C00;
    mov.b32 c, 0xD480D480;
    sub.f16x2 $0, $0, m;
    sub.f16x2 $1, $1, m;
    fma.rn.f16x2 $2, $2, s, c;
    fma.rn.f16x2 $3, $3, s, c;
}""")




@triton.jit
def _codes16(b, ASM: tl.constexpr):
    """A tile of packed bytes -> (even, odd) channel codes minus 8 (-8..7) as FP16 (exact), the low and the high
    nibbles, by the FP16 magic number (no integer-to-float conversion). ``ASM``: four bytes at a time in PTX, the
    way the fastest int4 kernels do it (BitDecoding's, FasterTransformer's): one byte permute (bytes 0, 2, 1, 3,
    so that each pair of halves holds two consecutive bytes' nibbles), one shift, four lop3 (mask, or the magic
    number), two FP16x2 subtractions and two FP16x2 FMAs for 8 codes; else the same bits element by element in
    Triton (what the interpreter runs; a test compares the two on a GPU)."""
    if ASM:
        lo, hi = tl.inline_asm_elementwise(_F16_CODES_ASM, "=r,=r,=r,=r,r", [b], dtype=(tl.float16, tl.float16),
                                           is_pure=False, pack=4)
    else:
        w = b.to(tl.int16)
        lo = ((w & 15) | 0x6400).to(tl.float16, bitcast=True) - 1032.0
        hi = ((w & 240) | 0x6400).to(tl.float16, bitcast=True) * 0.0625 - 72.0
    return lo, hi


@triton.jit
def _softcap(s, CAP: tl.constexpr, LOG2: tl.constexpr):
    """Scores ``s`` capped to CAP tanh(s / CAP) (Gemma 2's logit softcapping), in natural units or, ``LOG2``, in
    units of log 2 (the fast mode's exp2 softmax); tanh from one exponential: 1 - 2 / (exp(2 x) + 1), exact at
    both ends (+-1) and where x is 0."""
    x = s * 0.6931471805599453 if LOG2 else s
    t = CAP - (2.0 * CAP) / (tl.exp(x * (2.0 / CAP)) + 1.0)
    return t * 1.4426950408889634 if LOG2 else t
