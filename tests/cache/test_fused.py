"""The fused decode attention (kvcx.cache.store / fused) against attention over the decoded cache, in NumPy.

The packed data comes from the codecs themselves (real encodes); the reference decodes it and runs softmax
attention in float64. The model-level equality (logits, every layer, padding) is in test_kvcx_cache.py."""
import numpy as np
import pytest

from kvcx.cache import fused
from kvcx.cache.store import NO_MASK, PackedKV, fused_unsupported
from kvcx.codecs import E8PCodec, IntCodec, KVConfig, WidthCodec, decode
from kvcx.errors import CodecError

from helpers import kv_states as _kv, packed_store as _build  # noqa: E402


def _reference(q, K, V, mask, scaling):
    B, Hq, D = q.shape
    R = Hq // K.shape[1]
    out = np.zeros(q.shape, dtype=np.float64)
    for b in range(B):
        for h in range(Hq):
            s = K[b, h // R].astype(np.float64) @ q[b, h].astype(np.float64) * scaling
            if mask is not None:
                s = s + mask[b]
            p = np.exp(s - s.max())
            out[b, h] = (p / p.sum()) @ V[b, h // R].astype(np.float64)
    return out


def _reference_multi(q, K, V, keep, scaling):
    """q [B, Hq, Q, D]; keep [B, Q, kv_len] booleans (True attends)."""
    B, Hq, Q, D = q.shape
    R = Hq // K.shape[1]
    out = np.zeros(q.shape, dtype=np.float64)
    for b in range(B):
        for h in range(Hq):
            s = q[b, h].astype(np.float64) @ K[b, h // R].astype(np.float64).T * scaling
            s = np.where(keep[b], s, -np.inf)
            p = np.exp(s - s.max(-1, keepdims=True))
            out[b, h] = (p / p.sum(-1, keepdims=True)) @ V[b, h // R].astype(np.float64)
    return out


@pytest.mark.parametrize("scheme", ["kvcx", "reference", "kivi", "asymmetric", "kvcx3", "kvcx2", "kvcx2w", "kvcx4w",
                                    "kvcx2v"])
@pytest.mark.parametrize("B,H,R,chunks,nr", [(1, 3, 3, [128, 128, 128], 37), (2, 2, 4, [128], 1),
                                             (1, 1, 1, [256, 128], 64), (2, 3, 5, [256] * 5, 20),
                                             (1, 2, 2, [], 9)])
@pytest.mark.parametrize("threads", [1, 2])
def test_fused_equals_attention_over_the_decoded_cache(scheme, B, H, R, chunks, nr, threads):
    rng = np.random.default_rng(len(chunks) * 7 + B)
    D = 64
    T = sum(chunks)
    K, V = _kv(rng, B, H, T + nr, D)
    store, Kd, Vd = _build(KVConfig.from_scheme(scheme), K, V, chunks)
    rk, rv = np.ascontiguousarray(K[:, :, T:]), np.ascontiguousarray(V[:, :, T:])
    q = rng.standard_normal((B, H * R, D)).astype(np.float32)
    mask = np.zeros((B, T + nr), np.float32)
    if B > 1:
        mask[1, :min(50, T + nr - 1)] = -np.inf  # a left-padded row
    out = store.attend(q, rk, rv, mask, D ** -0.5, n_threads=threads)
    ref = _reference(q, np.concatenate([Kd, rk], 2), np.concatenate([Vd, rv], 2), mask, D ** -0.5)
    np.testing.assert_allclose(out, ref, atol=3e-5, rtol=1e-4)
    # no mask = all zeros; the output array can be passed in
    out2 = np.full_like(out, np.nan)
    store.attend(q, rk, rv, None, D ** -0.5, n_threads=threads, out=out2)
    np.testing.assert_allclose(out2, _reference(q, np.concatenate([Kd, rk], 2), np.concatenate([Vd, rv], 2), None,
                                                D ** -0.5), atol=3e-5, rtol=1e-4)


@pytest.mark.parametrize("kbits,vbits", [(3, 3), (2, 2), (3, 2), (2, 4), (4, 3)])
@pytest.mark.parametrize("asym", [False, True])
def test_low_bit_codes_every_layout(kbits, vbits, asym):
    """2- and 3-bit codes (widened tile by tile): per-token and per-channel keys, symmetric and asymmetric,
    rotated or not, mixed widths, sinks, a partial last tile and several splits."""
    rng = np.random.default_rng(kbits * 10 + vbits)
    scheme = "asymmetric" if asym else "symmetric"
    B, H, R, D = 2, 2, 3, 64
    for key in (IntCodec(bits=kbits, scheme=scheme, axis="token", sinks=1),
                IntCodec(bits=kbits, scheme="asymmetric", axis="channel", rotate=True, sinks=3)):
        kv = KVConfig(key=key, value=IntCodec(bits=vbits, scheme=scheme, rotate=not asym, sinks=1))
        assert fused_unsupported(kv.key, kv.value, D, R) is None
        chunks, nr = [128, 64, 256], 23
        T = sum(chunks)
        K, V = _kv(rng, B, H, T + nr, D)
        store, Kd, Vd = _build(kv, K, V, chunks)
        rk, rv = np.ascontiguousarray(K[:, :, T:]), np.ascontiguousarray(V[:, :, T:])
        q = rng.standard_normal((B, H * R, D)).astype(np.float32)
        mask = np.zeros((B, T + nr), np.float32)
        mask[1, :37] = -np.inf
        ref = _reference(q, np.concatenate([Kd, rk], 2), np.concatenate([Vd, rv], 2), mask, D ** -0.5)
        for threads in (1, 3):
            np.testing.assert_allclose(store.attend(q, rk, rv, mask, D ** -0.5, n_threads=threads), ref,
                                       atol=3e-5, rtol=1e-4)


@pytest.mark.parametrize("group_size", [16, 32, 64, 128, 256])
@pytest.mark.parametrize("bits,sinks", [(2.0, 1), (1.5, 0), (3.25, 3)])
def test_keys_with_a_width_per_channel(group_size, bits, sinks):
    """kvcx2w's keys (a width per channel, bit planes, groups of 16-256 tokens): chunks whose groups end part
    way (a group straddles no chunk: every chunk has its own widths), splits starting inside a group, width-0
    channels (their base alone), 1 and 3 threads, decode steps and a 14-token step (the float-tile rows); the
    store gives every chunk back byte for byte."""
    rng = np.random.default_rng(group_size + int(bits * 4) + sinks)
    B, H, R, D = 2, 2, 3, 64
    kv = KVConfig(key=WidthCodec(bits=bits, group_size=group_size, sinks=sinks),
                  value=IntCodec(bits=2, scheme="asymmetric", rotate=True, sinks=sinks))
    assert fused_unsupported(kv.key, kv.value, D, R) is None
    chunks, nr = [203, 64, 320, 96], 30
    T = sum(chunks)
    K, V = _kv(rng, B, H, T + nr, D)
    K[:, 1, :, :8] = 0.5   # flat channels: no codes there; wide ones: up to 8 bits
    K[:, 0, :, 8:16] *= np.array([4, 8, 12, 16, 20, 24, 28, 32], np.float32)
    store, Kd, Vd = _build(kv, K, V, chunks)
    widths = store.keys.widths.reshape(B * H, len(chunks), D)
    assert (widths == 0).any() and (widths > 4).any()
    o = 0
    for i, n in enumerate(chunks):   # the chunks as they were encoded, rebuilt from the kernel's tables
        c = kv.key if i == 0 else kv.key.replace(sinks=0)
        p, back = c.encode(np.ascontiguousarray(K[:, :, o:o + n])), store.keys.chunk(i)
        assert np.array_equal(p.codes, back.codes) and np.array_equal(p.scales, back.scales)
        o += n
    rk, rv = np.ascontiguousarray(K[:, :, T:]), np.ascontiguousarray(V[:, :, T:])
    Kf, Vf = np.concatenate([Kd, rk], 2), np.concatenate([Vd, rv], 2)
    q = (rng.standard_normal((B, H * R, D)) * 2).astype(np.float32)
    mask = np.zeros((B, T + nr), np.float32)
    mask[1, :45] = -np.inf
    ref = _reference(q, Kf, Vf, mask, D ** -0.5)   # (scores up to ~100 with the wide channels: atol 1e-4)
    for threads in (1, 3):
        np.testing.assert_allclose(store.attend(q, rk, rv, mask, D ** -0.5, n_threads=threads), ref,
                                   atol=1e-4, rtol=1e-4)
    Q = 14
    qm = rng.standard_normal((B, H * R, Q, D)).astype(np.float32)
    keep = np.ones((B, Q, T + nr), bool)
    keep[:, :, T + nr - Q:] = np.tril(np.ones((Q, Q), bool))
    keep[1, :, :45] = False
    np.testing.assert_allclose(store.attend(qm, rk, rv, keep, D ** -0.5, n_threads=2),
                               _reference_multi(qm, Kf, Vf, keep, D ** -0.5), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("D", [16, 32, 128, 256])
@pytest.mark.parametrize("scheme", ["kvcx", "reference", "kivi", "e8p-values"])
def test_steps_at_other_head_dims(scheme, D):
    """Head dims other than 64. Single-token steps: with AVX-512 the codes' products run 32 channels a vector (one
    block, 4, 8; 16 channels take the 8-lane products), rows per KV head 1, 4 and 7 (register blocks of 4 and a
    remainder), a batch row left-padded, 3 threads (token ranges that end part way through a block of 16 scores).
    A step of 29 tokens (3 x 29 = 87 rows: the float tiles, whole register blocks and a remainder; 16 channels a
    vector of 16 alone). Values in E8P records (kvcx2v's): one code per 8 channels, two per block of 16 (the
    accumulators' order), decoded in registers (few rows) or into the float tile (87 rows)."""
    rng = np.random.default_rng(D + len(scheme))
    kv = KVConfig(key=IntCodec(axis="channel", scheme="asymmetric", sinks=1), value=E8PCodec(sinks=1)) \
        if scheme == "e8p-values" else KVConfig.from_scheme(scheme, group_size=max(D, 64))
    B, H, nr = 2, 2, 33
    chunks = [256 + kv.value.sinks, 512 if D < 256 else 256]
    T = sum(chunks)
    K, V = _kv(rng, B, H, T + nr, D)
    V *= rng.uniform(0.1, 4.0, (B, H, T + nr, 1)).astype(np.float32)   # value scales that differ token to token
    store, Kd, Vd = _build(kv, K, V, chunks)
    rk, rv = np.ascontiguousarray(K[:, :, T:]), np.ascontiguousarray(V[:, :, T:])
    Kf, Vf = np.concatenate([Kd, rk], 2), np.concatenate([Vd, rv], 2)
    n = T + nr
    mask = np.zeros((B, n), np.float32)
    mask[1, :77] = -np.inf
    for R in (1, 4, 7):
        q = rng.standard_normal((B, H * R, D)).astype(np.float32)
        ref = _reference(q, Kf, Vf, mask, D ** -0.5)
        for threads in (1, 3):
            np.testing.assert_allclose(store.attend(q, rk, rv, mask, D ** -0.5, n_threads=threads), ref,
                                       atol=3e-5, rtol=1e-4)
    R, Q = 3, 29
    q = rng.standard_normal((B, H * R, Q, D)).astype(np.float32)
    keep = np.broadcast_to(np.arange(n)[None, :] <= (n - Q + np.arange(Q))[:, None], (B, Q, n))
    ref = _reference_multi(q, Kf, Vf, keep, D ** -0.5)
    for threads in (1, 2):
        np.testing.assert_allclose(store.attend(q, rk, rv, None, D ** -0.5, n_threads=threads), ref,
                                   atol=3e-5, rtol=1e-4)


def test_long_context_splits_across_threads_and_rotated_keys():
    """8,000 tokens split into token ranges per thread; keys rotated too (q rotated once)."""
    rng = np.random.default_rng(5)
    B, H, R, D = 1, 3, 3, 64
    kv = KVConfig(key=IntCodec(scheme="asymmetric", axis="channel", rotate=True, sinks=2),
                  value=IntCodec(scheme="asymmetric", rotate=True, sinks=0))
    K, V = _kv(rng, B, H, 8064, D)
    store, Kd, Vd = _build(kv, K, V, [128] * 63)
    q = (rng.standard_normal((B, H * R, D)) * 3).astype(np.float32)
    ref = _reference(q, Kd, Vd, None, 0.125)
    for threads in (1, 2, 3):
        np.testing.assert_allclose(store.attend(q, None, None, None, 0.125, n_threads=threads), ref,
                                   atol=3e-5, rtol=1e-4)


@pytest.mark.parametrize("scheme", ["kvcx", "reference", "kvcx3", "kvcx2", "kvcx2w", "kvcx4w", "kvcx2v"])
@pytest.mark.parametrize("B,H,R,Q,chunks,nr", [(2, 3, 3, 7, [128, 128], 9), (1, 2, 4, 40, [256, 64], 41),
                                              (2, 1, 1, 2, [128], 2), (1, 2, 3, 3, [192], 5),
                                              (1, 3, 3, 130, [512], 150)])
def test_multi_token_steps(scheme, B, H, R, Q, chunks, nr):
    """Q query tokens per row over the packed history and the residual (the step's own tokens its last Q):
    causal among them with no mask, a boolean and a float mask with left padding, one padding row broadcast
    over the tokens; both the per-row products (R x Q < 12 rows) and the float tiles (>= 12; kvcx2w's keys
    from 7 rows, 9 here)."""
    rng = np.random.default_rng(Q * 3 + B)
    D = 64
    T = sum(chunks)
    K, V = _kv(rng, B, H, T + nr, D)
    store, Kd, Vd = _build(KVConfig.from_scheme(scheme), K, V, chunks)
    rk, rv = np.ascontiguousarray(K[:, :, T:]), np.ascontiguousarray(V[:, :, T:])
    Kf, Vf = np.concatenate([Kd, rk], 2), np.concatenate([Vd, rv], 2)
    n = T + nr
    q = rng.standard_normal((B, H * R, Q, D)).astype(np.float32)
    causal = np.arange(n)[None, :] <= (n - Q + np.arange(Q))[:, None]           # [Q, n]
    keep = np.broadcast_to(causal, (B, Q, n)).copy()
    for threads in (1, 2):
        out = store.attend(q, rk, rv, None, D ** -0.5, n_threads=threads)
        np.testing.assert_allclose(out, _reference_multi(q, Kf, Vf, keep, D ** -0.5), atol=3e-5, rtol=1e-4)
    if B > 1:
        keep[1, :, :min(70, n - Q)] = False                                       # a left-padded row
    ref = _reference_multi(q, Kf, Vf, keep, D ** -0.5)
    np.testing.assert_allclose(store.attend(q, rk, rv, keep, D ** -0.5, n_threads=2), ref, atol=3e-5, rtol=1e-4)
    add = np.where(keep, 0.0, -np.inf).astype(np.float32)
    np.testing.assert_allclose(store.attend(q, rk, rv, add, D ** -0.5, n_threads=2), ref, atol=3e-5, rtol=1e-4)
    # a padding mask of one row per batch row ([B, 1, kv_len] as transformers may pass): the step stays causal
    pad = fused.step_mask(keep[:, -1:].copy(), B, Q)
    assert pad.causal and pad.qs == 0
    out = np.empty((B, H * R * Q, D), np.float32)
    store.step(q.reshape(B, -1, D), rk.reshape(B * H, nr, D), rv.reshape(B * H, nr, D), pad, D ** -0.5, 2, out, Q)
    np.testing.assert_allclose(out.reshape(q.shape), ref, atol=3e-5, rtol=1e-4)
    # one query token per row through the 4-D form equals the 3-D form
    one = store.attend(np.ascontiguousarray(q[:, :, -1]), rk, rv, None, D ** -0.5)
    np.testing.assert_allclose(store.attend(np.ascontiguousarray(q[:, :, -1:]), rk, rv, None, D ** -0.5)[:, :, 0], one,
                               atol=1e-6, rtol=1e-6)


def test_fully_masked_prefix_and_extreme_scores():
    """Masked tokens never leak in (even with scores far above the rest); exact zeros where masked."""
    rng = np.random.default_rng(1)
    kv = KVConfig.from_scheme("kvcx")
    K, V = _kv(rng, 2, 1, 256 + 5, 64)
    store, Kd, Vd = _build(kv, K, V, [256])
    rk, rv = np.ascontiguousarray(K[:, :, 256:]), np.ascontiguousarray(V[:, :, 256:])
    q = (rng.standard_normal((2, 1, 64)) * 40).astype(np.float32)  # sharp softmax: exp underflows widely
    mask = np.zeros((2, 261), np.float32)
    mask[0, :255] = -np.inf  # row 0 sees only the last 6 tokens
    out = store.attend(q, rk, rv, mask, 0.125, n_threads=2)
    ref = _reference(q, np.concatenate([Kd, rk], 2), np.concatenate([Vd, rv], 2), mask, 0.125)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, ref, atol=1e-4, rtol=1e-4)
    # the kernel flushes subnormal weights to zero inside its tasks only: this thread's float mode is restored
    tiny = np.array([1e-38], np.float32) * np.float32(1e-3)
    assert 0 < tiny[0] < np.finfo(np.float32).tiny


def test_masks_that_only_restate_causality_are_dropped():
    """A mask that hides nothing but what causality hides (transformers builds one for a step of several tokens
    after a prefix) becomes the kernel's causal flag, read by no layer; one that masks more stays a mask."""
    Q, kv = 5, 12
    causal = np.arange(kv)[None, :] <= (kv - Q + np.arange(Q))[:, None]
    assert fused.step_mask(causal[None].copy(), 1, Q) is fused.CAUSAL
    assert fused.step_mask(np.broadcast_to(causal, (2, Q, kv)).copy(), 2, Q) is fused.CAUSAL
    add = np.where(causal, 0.0, -np.inf).astype(np.float32)[None]
    assert fused.step_mask(add, 1, Q) is fused.CAUSAL
    assert fused.step_mask(np.ones((2, 1, kv), bool), 2, 1) is fused.NO_MASK
    assert fused.step_mask(np.ones((1, 1, kv), bool), 1, Q) is fused.CAUSAL   # a padding row that pads nothing
    padded = np.broadcast_to(causal, (2, Q, kv)).copy()
    padded[1, :, :3] = False
    m = fused.step_mask(padded, 2, Q)
    assert m.keep.shape == (2 * Q, kv) and not m.causal
    assert fused.step_mask(np.where(causal, 0.5, -np.inf).astype(np.float32)[None], 1, Q).add.shape == (Q, kv)
    shifted = causal.copy()
    shifted[0, kv - Q + 1] = True                                          # sees one token past its own
    assert fused.step_mask(shifted[None], 1, Q).keep.shape == (Q, kv)


def test_plan_follows_the_store_and_counts_its_workspace():
    rng = np.random.default_rng(2)
    kv = KVConfig.from_scheme("kvcx")
    K, V = _kv(rng, 1, 3, 512, 64)
    store, Kd, Vd = _build(kv, K, V, [128])
    q = rng.standard_normal((1, 9, 64)).astype(np.float32)
    store.attend(q, None, None, None, 0.125)
    before = store.nbytes
    nxt = [c.replace(sinks=0) for c in (kv.key, kv.value)]
    store.append(nxt[0].encode(np.ascontiguousarray(K[:, :, 128:256])), nxt[1].encode(np.ascontiguousarray(V[:, :, 128:256])))
    out = store.attend(q, None, None, None, 0.125)
    Kd2 = np.concatenate([Kd, decode(nxt[0].encode(np.ascontiguousarray(K[:, :, 128:256])))], 2)
    Vd2 = np.concatenate([Vd, decode(nxt[1].encode(np.ascontiguousarray(V[:, :, 128:256])))], 2)
    np.testing.assert_allclose(out, _reference(q, Kd2, Vd2, None, 0.125), atol=3e-5, rtol=1e-4)
    assert store.nbytes > before and store.nbytes >= store.keys.nbytes + store.values.nbytes + store.workspace.nbytes > 0


def test_what_the_kernel_does_not_take():
    k4, v4 = IntCodec(axis="channel", scheme="asymmetric"), IntCodec(rotate=True)
    assert fused_unsupported(k4, v4, 64, 3) is None
    assert fused_unsupported(IntCodec(bits=2), IntCodec(bits=3, rotate=True), 64, 3) is None
    assert "2-, 3- and 4-bit" in fused_unsupported(IntCodec(bits=8), v4, 64, 3)
    assert fused_unsupported(WidthCodec(bits=2.5), IntCodec(bits=2, scheme="asymmetric"), 64, 3) is None
    assert "IntCodec codes" in fused_unsupported(k4, WidthCodec(), 64, 3)
    assert fused_unsupported(WidthCodec(bits=2.5), E8PCodec(sinks=1), 64, 3) is None   # kvcx2v
    assert fused_unsupported(k4, E8PCodec(), 128, 3) is None
    assert "power-of-two" in fused_unsupported(k4, E8PCodec(), 48, 3)
    assert "'kvcx.e8p' keys" in fused_unsupported(E8PCodec(), v4, 64, 3)
    assert "multiple of 16" in fused_unsupported(k4, v4, 72, 3)
    assert "per token" in fused_unsupported(k4, IntCodec(axis="channel"), 64, 3)
    assert "whole tokens" in fused_unsupported(IntCodec(group_size=32), v4, 64, 3)
    assert "query heads" in fused_unsupported(k4, v4, 64, fused.ATTN_MAX_GROUP + 1)


def test_bad_inputs_are_clear_errors():
    rng = np.random.default_rng(3)
    kv = KVConfig.from_scheme("kvcx")
    K, V = _kv(rng, 1, 3, 128, 64)
    store, _, _ = _build(kv, K, V, [128])
    q = rng.standard_normal((1, 9, 64)).astype(np.float32)
    with pytest.raises(CodecError, match="q must be a C-contiguous float32"):
        store.attend(q.astype(np.float64), None, None, None, 0.125)
    with pytest.raises(CodecError, match="does not fit the packed stores"):
        store.attend(rng.standard_normal((1, 8, 64)).astype(np.float32), None, None, None, 0.125)
    with pytest.raises(CodecError, match="residual must be"):
        store.attend(q, np.zeros((1, 3, 2, 64), np.float32), np.zeros((1, 3, 3, 64), np.float32), None, 0.125)
    with pytest.raises(CodecError, match=r"mask must be a C-contiguous float32 or boolean \[1, 128\]"):
        store.attend(q, None, None, np.zeros((1, 127), np.float32), 0.125)
    with pytest.raises(CodecError, match="out must be"):
        store.attend(q, None, None, None, 0.125, out=np.empty((1, 9, 63), np.float32))
    with pytest.raises(CodecError, match="no tokens"):
        PackedKV(3, 64, kv.key, kv.value).attend(q, None, None, None, 0.125)
    eight = PackedKV(3, 64, IntCodec(bits=8), kv.value)
    eight.append(IntCodec(bits=8).encode(K), kv.value.encode(V))
    with pytest.raises(CodecError, match="2-, 3- and 4-bit codes"):
        eight.attend(q, None, None, None, 0.125)
    with pytest.raises(CodecError, match="does not fit this store"):
        store.append(kv.key.encode(K[:, :2]), kv.value.encode(V[:, :2]))
    with pytest.raises(CodecError, match="query tokens but 0 residual"):
        store.attend(rng.standard_normal((1, 9, 2, 64)).astype(np.float32), None, None, None, 0.125)
    with pytest.raises(CodecError, match="more than the kernel's"):
        big = fused.ATTN_MAX_ROWS // 3 + 1
        r = np.zeros((1, 3, big, 64), np.float32)
        store.attend(rng.standard_normal((1, 9, big, 64)).astype(np.float32), r, r, None, 0.125)
    with pytest.raises(CodecError, match=r"mask must be a C-contiguous float32 or boolean \[1, 2, 130\]"):
        r = np.zeros((1, 3, 2, 64), np.float32)
        store.attend(rng.standard_normal((1, 9, 2, 64)).astype(np.float32), r, r, np.zeros((1, 130), bool), 0.125)
    # step(): the per-layer path for callers that build the arrays (KvcxCache) still refuses sizes the
    # kernel would index out of bounds, and its typed arguments refuse other dtypes
    out = np.empty_like(q)
    r2 = np.zeros((3, 2, 64), np.float32)
    M = fused.Mask
    bad = [(q[:, :8].copy(), r2, r2, NO_MASK, out, 1),                       # query heads
           (q, r2, np.zeros((3, 3, 64), np.float32), NO_MASK, out, 1),       # residual keys vs values
           (q, np.zeros((2, 2, 64), np.float32), np.zeros((2, 2, 64), np.float32), NO_MASK, out, 1),
           (q, r2, r2, M(add=np.zeros((1, 129), np.float32), bs=1), out, 1),  # mask: 128 held + 2 residual
           (q, r2, r2, M(keep=np.ones((1, 130), np.uint8), bs=1, qs=1), out, 3),  # rows the mask lacks
           (q, r2, r2, M(add=np.zeros((1, 130), np.float32), bs=-1), out, 1),
           (q, r2, r2, NO_MASK, np.empty((1, 9, 32), np.float32), 1),
           (q, r2, r2, NO_MASK, out, 2),                                      # 9 rows are not 2 tokens per head
           (q, r2, r2, NO_MASK, out, 9),                                      # more tokens than the residual
           (np.empty((0, 9, 64), np.float32), r2, r2, NO_MASK, out, 1)]
    for args in bad:
        with pytest.raises(CodecError, match="do not fit the packed stores"):
            store.step(args[0], args[1], args[2], args[3], 0.125, 2, args[4], args[5])
    with pytest.raises(ValueError):
        store.step(q.astype(np.float64), r2, r2, NO_MASK, 0.125, 2, out)
    ref = store.attend(q, r2.reshape(1, 3, 2, 64), r2.reshape(1, 3, 2, 64), np.zeros((1, 130), np.float32), 0.125)
    np.testing.assert_array_equal(store.step(q, r2, r2, M(add=np.zeros((1, 130), np.float32), bs=1), 0.125, 2, out), ref)
