"""A plain NumPy implementation of the codec math, kept independent of kvcx's kernels."""
import numpy as np


def _fwht(x):
    """Orthonormal Walsh-Hadamard transform along the last axis (float32)."""
    d = x.shape[-1]
    y = x.astype(np.float32).copy()
    h = 1
    while h < d:
        y = y.reshape(*x.shape[:-1], d // (2 * h), 2, h)
        a, b = y[..., 0, :].copy(), y[..., 1, :].copy()
        y[..., 0, :] = a + b
        y[..., 1, :] = a - b
        y = y.reshape(x.shape)
        h *= 2
    return (y * np.float32(1.0 / np.sqrt(np.float32(d)))).astype(np.float32)


def quantize_groups(g, bits, asym):
    """g: [n_groups, G] float32 -> (codes uint8, scale f16, zero f16 or None)."""
    g = g.astype(np.float32)
    if asym:
        qmax = np.float32(2 ** bits - 1)
        mn, mx = g.min(axis=1), g.max(axis=1)
        s16 = ((mx - mn) / qmax).astype(np.float16)
        z16 = mn.astype(np.float16)
        s, z = s16.astype(np.float32)[:, None], z16.astype(np.float32)[:, None]
        with np.errstate(divide="ignore", invalid="ignore"):
            q = np.where(s == 0, 0, np.clip(np.rint((g - z) / np.where(s == 0, 1, s)), 0, qmax))
        return q.astype(np.uint8), s16, z16
    qmax = np.float32(2 ** (bits - 1) - 1)
    s16 = (np.abs(g).max(axis=1) / qmax).astype(np.float16)
    s = s16.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(s == 0, 0, np.clip(np.rint(g / np.where(s == 0, 1, s)), -qmax - 1, qmax))
    return (q + qmax + 1).astype(np.uint8), s16, None


def pack_bits(codes, bits):
    """LSB-first bit packing of a 1-D uint8 code array."""
    n = codes.size
    bitarr = ((codes[:, None].astype(np.uint16) >> np.arange(bits)) & 1).astype(np.uint8).reshape(-1)
    return np.packbits(bitarr, bitorder="little")[: (n * bits + 7) // 8]


def unpack_bits(packed, n, bits):
    bitarr = np.unpackbits(packed, bitorder="little")[: n * bits].reshape(n, bits)
    return (bitarr.astype(np.uint16) << np.arange(bits)).sum(axis=1).astype(np.uint8)


def encode(x, group_size=64, scheme="symmetric", bits=4, axis="token", rotate=False, sinks=0):
    """Reference encode of x viewed as (N, S, D) -> (codes, scales, zeros) like kvcx's kernels."""
    asym = scheme == "asymmetric"
    shape = x.shape
    if x.ndim >= 2:
        N, S, D = int(np.prod(shape[:-2])), shape[-2], shape[-1]
    else:
        N, S, D = 1, 1, int(np.prod(shape))
    t0 = min(sinks, S) if x.ndim >= 2 else 0
    v = x.astype(np.float32).reshape(N, S, D)[:, t0:, :]
    if rotate:
        v = _fwht(v)
    G = group_size
    codes, scales, zeros = [], [], []
    for n in range(N):
        slab = v[n]
        if axis == "token":
            flat = slab.reshape(-1)
            L = flat.size
            q = np.zeros(L, np.uint8)
            sc, zc = [], []
            for g0 in range(0, L, G):
                qq, s, z = quantize_groups(flat[g0:g0 + G][None, :], bits, asym)
                q[g0:g0 + G] = qq[0]
                sc.append(s)
                zc.append(z if z is not None else s)
            scales.append(np.concatenate(sc) if sc else np.zeros(0, np.float16))
            zeros.append(np.concatenate(zc) if zc else np.zeros(0, np.float16))
        else:
            T = slab.shape[0]
            q = np.zeros((T, D), np.uint8)
            sc, zc = [], []
            for t in range(0, T, G):
                blk = slab[t:t + G]              # [g, D] -> groups are columns
                qq, s, z = quantize_groups(blk.T, bits, asym)
                q[t:t + G] = qq.T
                sc.append(s)
                zc.append(z if z is not None else s)
            scales.append(np.concatenate(sc) if sc else np.zeros(0, np.float16))
            zeros.append(np.concatenate(zc) if zc else np.zeros(0, np.float16))
            q = q.reshape(-1)
        codes.append(pack_bits(q, bits))
    return (np.concatenate(codes), np.concatenate(scales), np.concatenate(zeros) if asym else None)


def decode_values(codes_u8, scale, zero, bits, asym):
    """Dequantize unsigned codes with per-element scale/zero arrays (float32)."""
    s = scale.astype(np.float32)
    if asym:
        return codes_u8.astype(np.float32) * s + zero.astype(np.float32)
    return (codes_u8.astype(np.float32) - np.float32(2 ** (bits - 1))) * s
