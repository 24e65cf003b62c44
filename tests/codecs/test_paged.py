"""The paged store (kvcx.codecs.paged): packed pages an engine's allocator owns, read through a block table
(vLLM's and FlashInfer's shape) by the same Triton kernel as the contiguous store. Triton's interpreter runs it
where there is no GPU (tests/conftest.py); nothing here is skipped for lack of one."""
import pytest
import torch

from kvcx.codecs import IntCodec, KVConfig, get_codec, gpu, paged, gpu_attn
from kvcx.errors import CodecError

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _codecs(scheme="kvcx"):
    """The scheme's key and value codecs without sinks (pages hold packed tokens only), on the Triton backend."""
    cfg = KVConfig.from_scheme(scheme)
    return tuple(get_codec({**c.get_config(), "sinks": 0}).with_backend("triton") for c in (cfg.key, cfg.value))


def _sequences(g, H, D, lens, shared):
    """Keys and values of each row; row 2 begins with row 0's first ``shared`` tokens (a shared prefix)."""
    seqs = []
    for b, n in enumerate(lens):
        K = (torch.randn(H, n, D, generator=g) + torch.randn(D, generator=g) * 2)
        V = torch.randn(H, n, D, generator=g)
        if b == 2 and shared:
            K[:, :shared], V[:, :shared] = seqs[0][0][:, :shared], seqs[0][1][:, :shared]
        seqs.append((K.to(DEVICE), V.to(DEVICE)))
    return seqs


@pytest.mark.parametrize("dot", ["int8x3", "fp16", "fp16-early", "fp16-prefetch"])
@pytest.mark.parametrize("keys", ["channel", "rotated"])
def test_paged_attention_equals_the_contiguous_store(dot, keys):
    """Three rows of odd lengths (a partial last page each but one) in scrambled pages of 64 tokens, row 2 sharing
    row 0's first page (the same prefix: the same bytes), the table's padding pointing at a page of NaN scales (not
    read): each row's output equals the contiguous store's over the same records (gpu_attn.attend, one row at a time),
    within FP32 rounding in the exact mode and, in the fast mode, within SDPA-BF16's own error of the FP32 result;
    also with a split's first tile loaded before the query ("fp16-early": row 1's splits past its length, over the
    padding's NaN page, count for nothing) and with each tile's scales loaded with the tile before it through the
    table ("fp16-prefetch": the same bits as without)."""
    launch = gpu_attn.LaunchSettings(dot=dot.split("-")[0], early_tile=dot.endswith("-early"),
                                     prefetch=dot.endswith("-prefetch"))
    dot = launch.dot
    kc, vc = _codecs()
    if keys == "rotated":   # the query rotated (and scaled) before the kernel, as for the contiguous store
        kc = IntCodec(scheme="asymmetric", axis="channel", rotate=True).with_backend("triton")
    g = torch.Generator().manual_seed(3)
    H, R, D, P = 2, 3, 64, 64
    lens = [150, 64, 97]
    pool = paged.allocate(kc, vc, 10, H, D, P, DEVICE)
    pool.key_scales[9], pool.value_scales[9] = float("nan"), float("nan")     # what no row may read
    seqs = _sequences(g, H, D, lens, shared=64)
    free = torch.randperm(9, generator=g).tolist()
    table = torch.full((3, 4), 9, dtype=torch.int32)
    pages = [free[0:3], free[3:4], [free[0], free[4]]]      # row 2: row 0's first page, then its own
    records = []
    for b, (K, V) in enumerate(seqs):
        pk, pv = kc.encode(K), vc.encode(V)
        records.append((pk, pv))
        if b == 2:   # its first page is row 0's: only its second is written
            pk2, pv2 = kc.encode(K[:, P:].contiguous()), vc.encode(V[:, P:].contiguous())
            paged.write(pool, pages[b][1:], pk2, pv2)
        else:
            paged.write(pool, pages[b], pk, pv)
        table[b, :len(pages[b])] = torch.tensor(pages[b], dtype=torch.int32)
    q = torch.randn(3, H * R, D, generator=g).to(DEVICE)
    lens_on = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    out = paged.attend(q, pool, table.to(DEVICE), lens_on, per_split=64, launch=launch)
    assert out.shape == q.shape and out.dtype == torch.float32 and bool(torch.isfinite(out).all())
    if launch.prefetch:   # loads moved, not arithmetic: the same bits as the scales loaded with their tile
        assert torch.equal(out, paged.attend(q, pool, table.to(DEVICE), lens_on, per_split=64,
                                             launch=launch.replace(prefetch=False)))
    plain = gpu_attn.LaunchSettings(dot=dot)
    for b, (pk, pv) in enumerate(records):
        alone = gpu_attn.attend(q[b:b + 1], gpu.to_device(_batched(pk), DEVICE), gpu.to_device(_batched(pv), DEVICE),
                           kc, vc, per_split=64, launch=plain)[0]
        Kd, Vd = (c.decode(p).repeat_interleave(R, 0).double() for c, p in ((kc, pk), (vc, pv)))
        ref = (torch.softmax((q[b].double()[:, None] @ Kd.transpose(-1, -2)) * D ** -0.5, -1) @ Vd)[:, 0]
        err = float((out[b].double() - ref).norm() / ref.norm())
        if dot == "fp16":
            low = torch.nn.functional.scaled_dot_product_attention(q[b].bfloat16()[:, None], Kd.bfloat16(),
                                                                   Vd.bfloat16())[:, 0]
            assert err <= float((low.double() - ref).norm() / ref.norm())
        else:
            assert err < 3e-5
            assert float((out[b] - alone).abs().max()) < 3e-5 * float(ref.abs().max())


def _batched(rec):
    """A record of [H, S, D] as one of [1, H, S, D] (gpu_attn.attend takes a batch)."""
    from kvcx.codecs.base import Packed

    return Packed(codes=rec.codes, scales=rec.scales, zeros=rec.zeros, sinks=rec.sinks, shape=(1, *rec.shape),
                  dtype=rec.dtype, config=dict(rec.config), meta=dict(rec.meta))


def test_a_page_written_alone_has_the_bytes_of_the_sequence_encoded_whole():
    """Per-channel key blocks lie within a page: a page encoded on its own (an engine's unit of work) holds the
    same bytes as the same tokens' page of the whole sequence encoded at once."""
    kc, vc = _codecs()
    g = torch.Generator().manual_seed(5)
    K, V = (torch.randn(2, 256, 64, generator=g).to(DEVICE) for _ in "kv")
    whole = paged.allocate(kc, vc, 4, 2, 64, 128, DEVICE)
    paged.write(whole, [2, 0], kc.encode(K), vc.encode(V))
    pages = paged.allocate(kc, vc, 4, 2, 64, 128, DEVICE)
    for page, (a, b) in ((2, (0, 128)), (0, (128, 256))):
        paged.write(pages, [page], kc.encode(K[:, a:b].contiguous()), vc.encode(V[:, a:b].contiguous()))
    for name in ("key_codes", "key_scales", "key_zeros", "value_codes", "value_scales"):
        assert torch.equal(getattr(whole, name), getattr(pages, name)), name
    assert whole.value_zeros is None and whole.nbytes == pages.nbytes > 0


def test_a_pool_of_two_widths_holds_each_at_its_own_and_attention_refuses_it():
    """``value_dim`` (MLA's latent and RoPE key: kvcx.cache.static_latent): keys of 64 channels and values of 32, a
    page written alone holding the bytes of the sequence encoded whole for each width; the paged attention, which
    reads keys and values of one width, refuses the pool by name; a width that is not a multiple of 16 is refused
    at allocation."""
    kc, vc = _codecs()
    g = torch.Generator().manual_seed(6)
    K, V = torch.randn(2, 256, 64, generator=g).to(DEVICE), torch.randn(2, 256, 32, generator=g).to(DEVICE)
    whole = paged.allocate(kc, vc, 4, 2, 64, 128, DEVICE, value_dim=32)
    assert (whole.head_dim, whole.value_dim) == (64, 32)
    paged.write(whole, [2, 0], kc.encode(K), vc.encode(V))
    pages = paged.allocate(kc, vc, 4, 2, 64, 128, DEVICE, value_dim=32)
    for page, (a, b) in ((2, (0, 128)), (0, (128, 256))):
        paged.write(pages, [page], kc.encode(K[:, a:b].contiguous()), vc.encode(V[:, a:b].contiguous()))
    for name in ("key_codes", "key_scales", "key_zeros", "value_codes", "value_scales"):
        assert torch.equal(getattr(whole, name), getattr(pages, name)), name
    assert whole.value_codes.shape[-1] * 2 == whole.key_codes.shape[-1]
    with pytest.raises(CodecError, match=r"values of shape \[2, 256, 64\] do not fit .* head dim 32"):
        paged.write(whole, [2, 0], kc.encode(K), vc.encode(K))
    lens = torch.tensor([100], dtype=torch.int32, device=DEVICE)
    with pytest.raises(CodecError, match="values 32: the kernel reads keys and values of one width"):
        paged.attend(torch.randn(1, 4, 64, device=DEVICE), whole, torch.zeros(1, 2, dtype=torch.int32,
                                                                               device=DEVICE), lens)
    with pytest.raises(CodecError, match="multiples of 16.*keys 64, values 24"):
        paged.allocate(kc, vc, 4, 2, 64, 128, DEVICE, value_dim=24)


def test_the_paged_store_refuses_what_it_cannot_hold_by_name():
    kc, vc = _codecs()
    cfg = KVConfig.from_scheme("kvcx")
    with pytest.raises(CodecError, match="sinks=0"):
        paged.allocate(cfg.key, vc, 4, 2, 64, 64, DEVICE)                       # exact sinks: not paged
    with pytest.raises(CodecError, match="whole groups.*multiple of 64"):
        paged.allocate(kc, vc, 4, 2, 64, 32, DEVICE)                            # 64-token key blocks
    with pytest.raises(CodecError, match="power of two"):
        paged.allocate(kc, vc, 4, 2, 64, 96, DEVICE)
    pool = paged.allocate(kc, vc, 4, 2, 64, 64, DEVICE)
    K = torch.randn(2, 100, 64, device=DEVICE)
    with pytest.raises(CodecError, match="page 7 is not in the pool of 4"):
        paged.write(pool, [0, 7], kc.encode(K), vc.encode(K))
    with pytest.raises(CodecError, match="100 key and 100 value tokens for 1 pages of 64"):
        paged.write(pool, [0], kc.encode(K), vc.encode(K))
    with pytest.raises(CodecError, match=r"shape \[3, 100, 64\].*2 KV heads"):
        paged.write(pool, [0, 1], kc.encode(torch.randn(3, 100, 64, device=DEVICE)), vc.encode(K))
    q = torch.randn(1, 4, 64, device=DEVICE)
    lens = torch.tensor([100], dtype=torch.int32, device=DEVICE)
    with pytest.raises(CodecError, match="block_table must be an int32"):
        paged.attend(q, pool, torch.zeros(1, 2, dtype=torch.int64, device=DEVICE), lens)
    with pytest.raises(CodecError, match="seq_lens must be an int32"):
        paged.attend(q, pool, torch.zeros(1, 2, dtype=torch.int32, device=DEVICE), lens[None])
    with pytest.raises(CodecError, match=r"q \[1, 3, 64\] does not fit"):
        paged.attend(torch.randn(1, 3, 64, device=DEVICE), pool, torch.zeros(1, 2, dtype=torch.int32,
                                                                              device=DEVICE), lens)


def test_a_mask_over_the_tables_tokens_hides_what_it_says_and_nothing_else():
    """``mask`` (a windowed layer's ring: 0 or -inf a token in table order, one row shared by the batch through a
    stride of 0): zeros change nothing, -inf over a page's first 40 tokens gives attention over its last 24 alone
    (those written on their own page); a mask of another shape or dtype is refused by name."""
    kc, vc = _codecs()
    pool = paged.allocate(kc, vc, 2, 2, 64, 64, DEVICE)
    K = torch.randn(2, 64, 64, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    paged.write(pool, [0], kc.encode(K), vc.encode(K))
    q = torch.randn(1, 4, 64, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    table, lens = torch.zeros(1, 1, dtype=torch.int32, device=DEVICE), torch.tensor([64], dtype=torch.int32,
                                                                                    device=DEVICE)
    row = torch.zeros(64, device=DEVICE)
    plain = paged.attend(q, pool, table, lens)
    assert torch.equal(paged.attend(q, pool, table, lens, mask=row.expand(1, -1)), plain)
    row[:40] = float("-inf")
    masked = paged.attend(q, pool, table, lens, mask=row.expand(1, -1))
    held_k, held_v = kc.decode(kc.encode(K)), vc.decode(vc.encode(K))
    kk, vv = (x[:, 40:].repeat_interleave(2, 0) for x in (held_k, held_v))
    ref = torch.softmax(q[0, :, None] @ kk.transpose(-1, -2) * 64 ** -0.5, -1) @ vv
    assert float((masked[0] - ref[:, 0]).abs().max()) < 2e-3 < float((plain[0] - ref[:, 0]).abs().max())
    with pytest.raises(CodecError, match=r"mask must be a float32 tensor \[1, 64\]"):
        paged.attend(q, pool, table, lens, mask=row[:32].expand(1, -1))
    with pytest.raises(CodecError, match="mask must be a float32"):
        paged.attend(q, pool, table, lens, mask=row.double().expand(1, -1))


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")   # the interpreter's 0 / 0
def test_a_row_of_no_tokens_gives_nan_as_sdpa_does_and_leaves_the_others():
    """seq_lens are read on the device (no host sync to check them): a row of 0 tokens has nothing to attend to and
    gives NaN, as SDPA does for a fully masked row; the batch's other rows are what they are alone."""
    kc, vc = _codecs()
    pool = paged.allocate(kc, vc, 2, 2, 64, 64, DEVICE)
    K = torch.randn(2, 64, 64, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    paged.write(pool, [1], kc.encode(K), vc.encode(K))
    q = torch.randn(2, 4, 64, device=DEVICE)
    table = torch.ones(2, 1, dtype=torch.int32, device=DEVICE)
    out = paged.attend(q, pool, table, torch.tensor([64, 0], dtype=torch.int32, device=DEVICE))
    alone = paged.attend(q[:1], pool, table[:1], torch.tensor([64], dtype=torch.int32, device=DEVICE))
    assert bool(torch.isnan(out[1]).all()) and torch.equal(out[0], alone[0])


def test_exact_sinks_and_a_residual_of_lengths_on_the_device_join_the_softmax():
    """Sinks [B, Hkv, 1, D] before the pages and a residual [B, Hkv, 16, D] after them of which row b's first
    residual_lens[b] are tokens (3 and 16 here; the rest NaN, never read), in one softmax with the pages: within FP32
    rounding of FP32 attention over the sinks, the decoded pages and the live residual (the exact mode). A row with
    no packed token yet (seq_lens 0) attends to its exact tokens alone. Pages of 192 tokens (not a power of two: a
    multiple of the kernel's tiles) are taken."""
    kc, vc = _codecs()
    g = torch.Generator().manual_seed(8)
    B, H, R, D, P = 2, 2, 2, 64, 192
    pool = paged.allocate(kc, vc, 2, H, D, P, DEVICE)
    K, V = (torch.randn(H, 150, D, generator=g).to(DEVICE) for _ in "kv")
    paged.write(pool, [1], kc.encode(K), vc.encode(V))
    sinks = tuple(torch.randn(B, H, 1, D, generator=g).to(DEVICE) for _ in "kv")
    res = tuple(torch.randn(B, H, 16, D, generator=g).to(DEVICE) for _ in "kv")
    live = [3, 16]
    for r in res:
        r[0, :, 3:] = float("nan")
    q = torch.randn(B, H * R, D, generator=g).to(DEVICE)
    table = torch.ones(B, 1, dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([150, 0], dtype=torch.int32, device=DEVICE)
    out = paged.attend(q, pool, table, lens, sinks=sinks, residual=res,
                       residual_lens=torch.tensor(live, dtype=torch.int32, device=DEVICE),
                       launch=gpu_attn.LaunchSettings(dot="int8x3"))
    Kd, Vd = kc.decode(kc.encode(K)), vc.decode(vc.encode(V))
    for b in range(B):
        packed = 150 if b == 0 else 0
        keys = torch.cat([sinks[0][b], Kd[:, :packed], res[0][b, :, :live[b]]], 1).repeat_interleave(R, 0).double()
        vals = torch.cat([sinks[1][b], Vd[:, :packed], res[1][b, :, :live[b]]], 1).repeat_interleave(R, 0).double()
        ref = (torch.softmax((q[b].double()[:, None] @ keys.transpose(-1, -2)) * D ** -0.5, -1) @ vals)[:, 0]
        assert float((out[b].double() - ref).norm() / ref.norm()) < 3e-5, b
    with pytest.raises(CodecError, match="residual_lens must be an int32 tensor \\[2\\]"):
        paged.attend(q, pool, table, lens, residual=res, residual_lens=lens.long())
    with pytest.raises(CodecError, match="sinks' .and the residual's. keys and values alike"):
        paged.attend(q, pool, table, lens, sinks=(sinks[0], None))
    with pytest.raises(CodecError, match="residual keys must be a float tensor \\[2, 2, n, 64\\]"):
        paged.attend(q, pool, table, lens, residual=(res[0][:, :1], res[1]))


@pytest.mark.parametrize("scheme", ["kvcx", "kivi"])
def test_a_decode_step_writes_its_token_and_encodes_a_full_residual_into_its_page_in_place(scheme):
    """paged.encode_step (a static cache's one launch a kind and layer): each step writes its token into
    the residual at its slot (exactly; the packed rows untouched while the residual is not full), and the step that
    fills the residual encodes it into its page of the rows with the bytes the codec writes for those tokens alone
    (the CPU's), the other pages' bytes unchanged. Both groupings: keys per channel with zero points, values per
    token rotated (kvcx) or with zero points (kivi); a NaN token sets the flag at its own step."""
    g = torch.Generator().manual_seed(11)
    B, H, P, D, pages = 2, 2, 64, 64, 3
    for codec in _codecs(scheme):
        pool = paged.allocate(codec, codec, B * H, 1, D, P * pages, DEVICE)   # B x H rows of `pages` pages
        rows = [t.view(torch.uint8) for t in (pool.key_codes, pool.key_scales, pool.key_zeros) if t is not None]
        for t in rows:   # what the pages held before (compared as bytes)
            t.copy_(torch.randint(0, 256, t.shape, generator=g))
        before = [t.clone() for t in rows]
        res = torch.zeros(B, H, P, D, device=DEVICE)
        flag = torch.zeros(2, dtype=torch.int32, device=DEVICE)
        tokens = torch.randn(B, H, P, D, generator=g).to(DEVICE)
        where = torch.tensor([0, 1], dtype=torch.int64, device=DEVICE)      # page 1 of 3
        for slot in range(P):
            where[0] = slot
            paged.encode_step(codec, res, pool.key_codes, pool.key_scales, pool.key_zeros, flag,
                              tokens[:, :, slot:slot + 1].contiguous(), where)
            assert torch.equal(res[:, :, :slot + 1], tokens[:, :, :slot + 1])
            if slot < P - 1:
                assert all(torch.equal(a, b) for a, b in zip(rows, before))
        rec = codec.with_backend("cpu").encode(tokens.cpu())
        codes = pool.key_codes.view(B * H, pages, -1).cpu()
        assert torch.equal(codes[:, 1].reshape(-1), torch.as_tensor(rec.codes).reshape(-1))
        for t, want in zip(rows[1:], (rec.scales, rec.zeros)):
            assert torch.equal(t.view(torch.float16).view(B * H, pages, -1)[:, 1].cpu().reshape(-1),
                               torch.as_tensor(want).reshape(-1))
        for t, b in zip(rows, before):   # pages 0 and 2 as they were
            assert torch.equal(t.view(B * H, pages, -1)[:, ::2], b.view(B * H, pages, -1)[:, ::2])
        assert not bool(flag.any())
        bad = tokens[:, :, :1].clone().contiguous()
        bad[1, 0, 0, 5] = float("nan")
        where[0] = 0
        paged.encode_step(codec, res, pool.key_codes, pool.key_scales, pool.key_zeros, flag, bad, where)
        assert bool(flag.any())
    with pytest.raises(CodecError, match="the new token must be \\[2, 2, 1, 64\\] in torch.float32"):
        paged.encode_step(codec, res, pool.key_codes, pool.key_scales, pool.key_zeros, flag, bad.half(), where)
    with pytest.raises(CodecError, match="where int64 \\[2\\]"):
        paged.encode_step(codec, res, pool.key_codes, pool.key_scales, pool.key_zeros, flag, bad, where.int())
    with pytest.raises(CodecError, match="does not fit the rows given"):
        paged.encode_step(codec, res, pool.key_codes[:-1], pool.key_scales, pool.key_zeros, flag, bad, where)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_the_attention_written_in_the_callers_dtype_is_the_float32_result_rounded(dtype):
    """paged.attend's ``out=``: the merge writes the model's dtype itself (no conversion launched after it); the
    values are the FP32 output rounded to nearest even, as ``.to(dtype)`` rounds it, bit for bit."""
    kc, vc = _codecs()
    g = torch.Generator().manual_seed(4)
    pool = paged.allocate(kc, vc, 2, 2, 64, 64, DEVICE)
    K, V = (torch.randn(2, 64, 64, generator=g).to(DEVICE) * 50 for _ in "kv")
    paged.write(pool, [1], kc.encode(K), vc.encode(V))
    q = torch.randn(1, 4, 64, generator=g).to(DEVICE)
    table, lens = torch.ones(1, 1, dtype=torch.int32, device=DEVICE), torch.tensor([64], dtype=torch.int32,
                                                                                    device=DEVICE)
    ref = paged.attend(q, pool, table, lens)
    out = torch.empty(1, 4, 64, dtype=dtype, device=DEVICE)
    assert paged.attend(q, pool, table, lens, out=out) is not None
    assert torch.equal(out, ref.to(dtype))
    with pytest.raises(CodecError, match="out must be a contiguous float32, float16 or bfloat16 tensor of 256"):
        paged.attend(q, pool, table, lens, out=torch.empty(1, 4, 64, dtype=torch.float64, device=DEVICE))
