"""What the fused CPU attention does for the layer kinds of 2026's models, against attention over the decoded cache in
float64 (the reference of test_fused.py, extended):

- logit softcapping (Gemma 2): scores s capped to cap tanh(s / cap) before the mask;
- per-head sinks (GPT-OSS's ``s_aux``): a logit per query head in the softmax's sum, attending to nothing;
- a window's first token (sliding and chunked layers): the packed tokens before it are not read (``skip``), and
  packed chunks the window left are dropped from the store (``drop_chunks``), the rest read as before.
"""
import numpy as np
import pytest

from kvcx.codecs import KVConfig
from kvcx.errors import CodecError

from helpers import kv_states as _kv, packed_store, without_sinks  # noqa: E402


def _reference(q, K, V, keep, scaling, softcap=None, sinks=None):
    """q [B, Hq, Q, D] over K, V [B, Hkv, kv_len, D]; keep [B, Q, kv_len] booleans; sinks [Hq] or None."""
    B, Hq, Q, D = q.shape
    R = Hq // K.shape[1]
    out = np.zeros(q.shape[:-1] + (V.shape[-1],), dtype=np.float64)
    for b in range(B):
        for h in range(Hq):
            s = q[b, h].astype(np.float64) @ K[b, h // R].astype(np.float64).T * scaling
            if softcap:
                s = softcap * np.tanh(s / softcap)
            s = np.where(keep[b], s, -np.inf)
            z = np.full((Q, 1), -np.inf) if sinks is None else np.full((Q, 1), float(sinks[h]))
            m = np.maximum(s.max(-1, keepdims=True), z)
            p = np.exp(s - m)
            denom = p.sum(-1, keepdims=True) + np.exp(z - m)
            out[b, h] = (p / denom) @ V[b, h // R].astype(np.float64)
    return out


def _store(scheme, K, V, chunks, sinks_first=True):
    kv = KVConfig.from_scheme(scheme)
    return packed_store(kv if sinks_first else without_sinks(kv), K, V, chunks)


@pytest.mark.parametrize("scheme", ["kvcx", "kivi", "kvcx2", "kvcx2w"])
@pytest.mark.parametrize("Q", [1, 5])
@pytest.mark.parametrize("softcap,with_sinks", [(None, True), (3.0, False), (2.0, True)])
def test_softcap_and_sinks_equal_the_reference(scheme, Q, softcap, with_sinks):
    rng = np.random.default_rng(Q * 11 + int(softcap or 0))
    B, H, R, D, chunks, nr = 2, 2, 3, 64, [128, 128], 9
    T = sum(chunks)
    K, V = _kv(rng, B, H, T + nr, D)
    store, Kd, Vd = _store(scheme, K, V, chunks)
    q = rng.standard_normal((B, H * R, Q, D)).astype(np.float32)
    sinks = (rng.standard_normal(H * R) * 2).astype(np.float32) if with_sinks else None
    if with_sinks:
        sinks[0] = 40.0    # a sink far above every score: that head's output is near 0
    keep = np.ones((B, Q, T + nr), bool)
    keep[1, :, :7] = False                                    # left padding of row 1
    keep &= np.tri(Q, T + nr, T + nr - Q, dtype=bool)[None]   # causal among the step's tokens
    out = store.attend(q if Q > 1 else q[:, :, 0], np.ascontiguousarray(K[:, :, T:]),
                       np.ascontiguousarray(V[:, :, T:]), keep if Q > 1 else keep[:, 0], 0.125, sinks=sinks,
                       softcap=softcap)
    ref = _reference(q, np.concatenate([Kd, K[:, :, T:]], 2), np.concatenate([Vd, V[:, :, T:]], 2), keep, 0.125,
                     softcap, sinks)
    np.testing.assert_allclose(out.reshape(ref.shape), ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("scheme", ["kvcx", "kivi", "kvcx3", "kvcx2w"])
@pytest.mark.parametrize("skip", [0, 1, 63, 64, 100, 256])
def test_a_window_start_skips_the_packed_tokens_before_it(scheme, skip):
    """``skip`` packed tokens not read: the same as attention over the tokens from the window's first on,
    mid-block starts included (keys grouped per 64 channels' tokens)."""
    rng = np.random.default_rng(skip)
    B, H, R, D, chunks, nr = 2, 2, 2, 64, [64, 128, 64], 5
    T = sum(chunks)
    K, V = _kv(rng, B, H, T + nr, D)
    store, Kd, Vd = _store(scheme, K, V, chunks, sinks_first=False)
    q = rng.standard_normal((B, H * R, D)).astype(np.float32)
    out = store.attend(q, np.ascontiguousarray(K[:, :, T:]), np.ascontiguousarray(V[:, :, T:]), None, 0.2, skip=skip)
    Kw = np.concatenate([Kd, K[:, :, T:]], 2)[:, :, skip:]
    Vw = np.concatenate([Vd, V[:, :, T:]], 2)[:, :, skip:]
    ref = _reference(q[:, :, None], Kw, Vw, np.ones((B, 1, Kw.shape[2]), bool), 0.2)
    np.testing.assert_allclose(out, ref[:, :, 0], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("scheme", ["kvcx", "kvcx2w"])
def test_dropped_chunks_leave_the_later_ones_read_as_before(scheme):
    """A window drops whole chunks from the front: the store then attends as one built from the later chunks
    alone (bit for bit: the same codes are read), and its bytes shrink by what was dropped."""
    rng = np.random.default_rng(5)
    B, H, R, D = 1, 2, 4, 64
    chunks = [64, 64, 128, 64]
    K, V = _kv(rng, B, H, sum(chunks) + 3, D)
    store, _, _ = _store(scheme, K, V, chunks, sinks_first=False)
    q = rng.standard_normal((B, H * R, D)).astype(np.float32)
    rk, rv = (np.ascontiguousarray(x[:, :, sum(chunks):]) for x in (K, V))
    before = store.nbytes
    assert store.drop_chunks(2) == 128
    assert store.tokens == 192 and len(store) == 2 and store.nbytes < before
    later, _, _ = _store(scheme, K[:, :, 128:], V[:, :, 128:], chunks[2:], sinks_first=False)
    a = store.attend(q, rk, rv, None, 0.125)
    b = later.attend(q, rk, rv, None, 0.125)
    np.testing.assert_array_equal(a, b)
    # then a chunk appended after the drop is read with them
    kv = KVConfig.from_scheme(scheme)
    k2, v2 = _kv(rng, B, H, 64, D)
    for s in (store, later):
        s.append(kv.key.replace(sinks=0).encode(k2), kv.value.replace(sinks=0).encode(v2))
    np.testing.assert_array_equal(store.attend(q, rk, rv, None, 0.125), later.attend(q, rk, rv, None, 0.125))
    assert store.drop_chunks(3) == 256 and store.tokens == 0


def test_bad_sinks_softcap_and_skip_are_clear_errors():
    rng = np.random.default_rng(0)
    K, V = _kv(rng, 1, 2, 64, 64)
    store, _, _ = _store("kvcx", K, V, [64], sinks_first=False)
    q = rng.standard_normal((1, 4, 64)).astype(np.float32)
    with pytest.raises(CodecError, match=r"one logit per query head \(\[4\]\)"):
        store.attend(q, None, None, None, 0.1, sinks=np.zeros(3, np.float32))
    with pytest.raises(CodecError, match="no NaN"):
        store.attend(q, None, None, None, 0.1, sinks=np.full(4, np.nan, np.float32))
    with pytest.raises(CodecError, match="softcap must be a positive number"):
        store.attend(q, None, None, None, 0.1, softcap=-1.0)
    with pytest.raises(CodecError, match="skip=65 must be a count of the 64 packed tokens"):
        store.attend(q, None, None, None, 0.1, skip=65)
    with pytest.raises(CodecError, match="cannot drop 2 of 1 packed chunks"):
        store.drop_chunks(2)
    first, _, _ = _store("kvcx", K, V, [64])   # the first chunk keeps an exact sink token
    with pytest.raises(CodecError, match="exact sink tokens stay"):
        first.drop_chunks(1)


@pytest.mark.parametrize("scheme,bits", [("kvcx", None), ("kivi", None), ("kvcx", 3),
                                         ("kvcx", 2), ("kvcx2w", None)])
@pytest.mark.parametrize("D,group", [(128, 64), (256, 64), (128, 32), (64, 16)])
@pytest.mark.parametrize("R,Q", [(2, 1), (4, 5)])
def test_values_in_several_groups_a_token(scheme, bits, D, group, R, Q):
    """Head dims above the values' group (the default scheme's 64 values at head dim 128, Gemma's 256): a token's
    values carry D / G scales (and zero points), each on its own channels; the fused step equals attention over
    the decoded cache, few rows and many (a multi-token step)."""
    from kvcx.codecs import KVConfig as K
    kv = K.from_scheme(scheme, **({"bits": bits} if bits else {}))
    kv = K(key=kv.key, value=kv.value.replace(group_size=group), scheme=kv.scheme)
    rng = np.random.default_rng(D + group + R)
    B, H, chunks, nr = 2, 2, [64, 128], 7
    T = sum(chunks)
    K_, V = _kv(rng, B, H, T + nr, D)
    V += rng.standard_normal((1, 1, 1, D)).astype(np.float32) * 2    # per-channel offsets the zero points carry
    store, Kd, Vd = packed_store(without_sinks(kv), K_, V, chunks)
    assert store.unsupported(D, R) is None
    q = rng.standard_normal((B, H * R, Q, D)).astype(np.float32)
    keep = np.ones((B, Q, T + nr), bool) & np.tri(Q, T + nr, T + nr - Q, dtype=bool)[None]
    keep[1, :, :5] = False
    out = store.attend(q if Q > 1 else q[:, :, 0], np.ascontiguousarray(K_[:, :, T:]),
                       np.ascontiguousarray(V[:, :, T:]), keep if Q > 1 else keep[:, 0], D ** -0.5)
    ref = _reference(q, np.concatenate([Kd, K_[:, :, T:]], 2), np.concatenate([Vd, V[:, :, T:]], 2), keep,
                     D ** -0.5)
    np.testing.assert_allclose(out.reshape(ref.shape), ref, atol=3e-5, rtol=1e-4)
