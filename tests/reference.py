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


def widths_encode(x, bits, group_size, sinks, weights=None, wmax=8, middle=False):
    """The per-channel widths codec (docs/FORMAT.md 2.4) in NumPy: (codes bytes, channel ranges F16 [N, D, 2],
    decoded float32). The widths are the ``bits * D * N`` best bits over the tensor's channels, taken one by
    one in order of gain."""
    shape = x.shape
    S, D = shape[-2], shape[-1]
    xs = x.reshape(-1, S, D).astype(np.float32)
    N = xs.shape[0]
    t0 = min(sinks, S)
    gs = group_size
    G = -(-(S - t0) // gs)
    groups = [(t0 + g * gs, min(S, t0 + (g + 1) * gs)) for g in range(G)]
    mn = np.stack([xs[:, a:b].min(1) for a, b in groups], 1)
    mx = np.stack([xs[:, a:b].max(1) for a, b in groups], 1)
    lo, hi = mn.min(1), mx.max(1)
    lo16, hi16 = lo.astype(np.float16), hi.astype(np.float16)
    lo16 = np.where(lo16.astype(np.float32) > lo, np.nextafter(lo16, np.float16(-np.inf)), lo16)
    hi16 = np.where(hi16.astype(np.float32) < hi, np.nextafter(hi16, np.float16(np.inf)), hi16)
    rows = np.array([b_ - a_ for a_, b_ in groups], dtype=np.float64)
    spread = (((mx.astype(np.float64) - mn.astype(np.float64)) ** 2) * rows[None, :, None]).sum(1)
    if weights is not None:
        spread = spread * np.tile(np.asarray(weights, np.float64), (N // len(weights), 1))
    err = np.array([1.0] + [1.0 / (2 ** w - 1) ** 2 for w in range(1, wmax + 1)])
    gains = [(spread[n, d] * ((err[0] - err[2]) / 2 if k < 2 else err[k] - err[k + 1]), n, d)
             for n in range(N) for d in range(D) for k in range(wmax)]
    gains.sort(key=lambda t: -t[0])
    widths = np.zeros((N, D), dtype=np.int64)
    for _, n, d in gains[:int(round(bits * D)) * N]:
        widths[n, d] += 1
    # a width-0 channel's group range brackets the group's mean (the rows summed in float, in order)
    means = np.stack([np.cumsum(xs[:, a_:b_], axis=1, dtype=np.float32)[:, -1] / np.float32(b_ - a_)
                      for a_, b_ in groups], 1)
    zero = (widths == 0)[:, None, :] & (not middle)   # middle: as encoders before the mean did
    mn, mx = np.where(zero, means, mn), np.where(zero, means, mx)
    L, H = lo16.astype(np.float32)[:, None], hi16.astype(np.float32)[:, None]
    span = (H - L) / np.float32(255)
    safe = np.where(span > 0, span, np.float32(1))
    a = np.where(span > 0, np.clip(np.floor((mn - L) / safe), 0, 255), 0)
    b = np.where(span > 0, np.clip(np.ceil((mx - L) / safe), 0, 255), 0)
    b = np.maximum(a, b)
    glo, ghi = L + a.astype(np.float32) * span, L + b.astype(np.float32) * span
    top = (2.0 ** widths - 1).astype(np.float32)[:, None, :]
    step = (ghi - glo) / np.maximum(top, 1)
    inv = np.where((step > 0) & (top > 0), 1 / np.where(step > 0, step, 1), 0).astype(np.float32)
    dec = xs.copy()
    planes = []
    for n in range(N):
        for g, (ga, gb) in enumerate(groups):
            q = np.clip(np.rint((xs[n, ga:gb] - glo[n, g]) * inv[n, g]), 0, top[n, 0]).astype(np.int64)
            base = np.where(top[n, 0] > 0, glo[n, g], (glo[n, g] + ghi[n, g]) / 2)
            dec[n, ga:gb] = base + np.where(top[n, 0] > 0, step[n, g], 0).astype(np.float32) * q.astype(np.float32)
            full = np.zeros((gs, D), dtype=np.int64)
            full[:gb - ga] = q
            for d in range(D):
                for j in range(widths[n, d]):
                    planes.append(np.packbits(((full[:, d] >> j) & 1).astype(np.uint8), bitorder="little"))
    stats = np.stack([a, b], -1).astype(np.uint8)
    codes = np.concatenate([widths.astype(np.uint8).reshape(-1), stats.reshape(-1)]
                           + planes).astype(np.uint8)
    return codes, np.stack([lo16, hi16], -1), dec.reshape(shape)
