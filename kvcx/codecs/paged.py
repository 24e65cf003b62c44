"""A paged packed store: keys and values in fixed-size pages that an engine's allocator owns, read through a block
table, and the fused decode step over it.

Serving engines (vLLM, FlashInfer, SGLang) do not keep a sequence's cache in one row: they hand out pages of a
fixed number of tokens from a pool and give the attention a block table, ``block_table[B, max_pages]`` (row b's
pages in order) and ``seq_lens[B]`` (row b's tokens). :class:`PagedKV` is such a pool in kvcx's packed format
(4-bit codes, FP16 scales and zero points; page p's KV head h at slot p x Hkv + h), :func:`write` puts a record's
tokens into pages, and :func:`attend` runs one decode step over the pages with the same Triton kernel as the
contiguous store (:func:`kvcx.codecs.gpu_attn.attend_spans`; its ``PAGE`` mode reads each tile's page from the table):
no copy, no host sync (the splits are sized from the table's width, so a step can be captured in a CUDA graph).

A page holds whole groups: per-channel key blocks (the default's 64 tokens) lie within a page, so that a page is
encoded on its own with the same bytes as the sequence encoded whole; pages are a multiple of the key blocks.
Pages hold packed tokens only (no exact sinks or residual): what an engine pages is what it has encoded.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

from kvcx.codecs import gpu, gpu_attn
from kvcx.codecs.backends import is_tensor
from kvcx.codecs.base import Codec, Packed
from kvcx.codecs.dtypes import is_int
from kvcx.deps import import_torch as _torch
from kvcx.errors import CodecError


@dataclass(frozen=True)
class PagedKV:
    """A pool of pages of packed keys and values: codes uint8 [pages, Hkv, page_tokens x D / 2]; scales (and zero
    points, or None) FP16 [pages, Hkv, page_tokens / G, D] for per-channel groups of G tokens or [pages, Hkv,
    page_tokens x D / G] for per-token groups of G values. Values may be of another width than keys (``value_dim``:
    MLA's latent and RoPE key, :mod:`kvcx.cache.static_latent`); :func:`attend` reads keys and values of one."""

    key_codes: object
    key_scales: object
    key_zeros: object
    value_codes: object
    value_scales: object
    value_zeros: object
    key_codec: Codec
    value_codec: Codec
    page_tokens: int

    @property
    def num_pages(self) -> int:
        return self.key_codes.shape[0]

    @property
    def kv_heads(self) -> int:
        return self.key_codes.shape[1]

    @property
    def head_dim(self) -> int:
        return self.key_codes.shape[2] * 2 // self.page_tokens

    @property
    def value_dim(self) -> int:
        return self.value_codes.shape[2] * 2 // self.page_tokens

    @property
    def nbytes(self) -> int:
        """Bytes the pool holds (codes, scales, zero points)."""
        parts = (self.key_codes, self.key_scales, self.key_zeros, self.value_codes, self.value_scales,
                 self.value_zeros)
        return sum(t.numel() * t.element_size() for t in parts if t is not None)


def _check_codec(codec, what: str, page_tokens: int, D: int) -> None:
    if getattr(codec, "codec_id", None) != "kvcx.int" or codec.bits != 4:
        raise CodecError(f"paged store: the {what} must use a 4-bit kvcx.int codec, got "
                         f"{getattr(codec, 'codec_id', codec)!r}")
    if codec.sinks:
        raise CodecError(f"paged store: the {what} codec keeps {codec.sinks} exact sink tokens; pages hold packed "
                         "tokens only: use the codec with sinks=0")
    G = codec.group_size
    whole = page_tokens % G == 0 if codec.axis == "channel" else page_tokens * D % G == 0
    if not whole:
        unit = f"{G} tokens (per-channel blocks)" if codec.axis == "channel" else f"{G} values (per-token groups)"
        raise CodecError(f"paged store: pages of {page_tokens} tokens do not hold whole groups of the {what}' "
                         f"{unit}: choose page_tokens a multiple of {G if codec.axis == 'channel' else G // D or 1}")


def _params_shape(codec, pages: int, H: int, P: int, D: int) -> tuple:
    G = codec.group_size
    return (pages, H, P // G, D) if codec.axis == "channel" else (pages, H, P * D // G)


def allocate(key_codec: Codec, value_codec: Codec, num_pages: int, kv_heads: int, head_dim: int, page_tokens: int,
             device, value_dim: Optional[int] = None) -> PagedKV:
    """An empty pool of ``num_pages`` pages of ``page_tokens`` tokens for ``kv_heads`` heads of ``head_dim``
    (values of ``value_dim``: None, the same), on ``device``. Pages hold whole groups of both codecs and at least 16
    tokens (the products' tiles): a power of two, or a multiple of the kernel's tiles (a page a row as long as a
    sequence: :mod:`kvcx.cache.static_cache`)."""
    torch = _torch()
    if not is_int(page_tokens) or page_tokens < 16 or (page_tokens & (page_tokens - 1) and
                                                      page_tokens % gpu_attn.TILE_TOKENS):
        raise CodecError(f"paged store: page_tokens must be a power of two from 16 or a multiple of "
                         f"{gpu_attn.TILE_TOKENS} (the kernel's tiles lie within a page), got {page_tokens!r}")
    Dv = head_dim if value_dim is None else value_dim
    if num_pages < 1 or kv_heads < 1 or min(head_dim, Dv) < 16 or head_dim % 16 or Dv % 16:
        raise CodecError(f"paged store: need num_pages >= 1, kv_heads >= 1 and head dims that are multiples of 16; "
                         f"got {num_pages}, {kv_heads}, keys {head_dim}, values {Dv}")
    for codec, what, d in ((key_codec, "keys", head_dim), (value_codec, "values", Dv)):
        _check_codec(codec, what, page_tokens, d)
    P, H = page_tokens, kv_heads

    def params(codec, D):
        shape = _params_shape(codec, num_pages, H, P, D)
        return (torch.zeros(shape, dtype=torch.float16, device=device),
                torch.zeros(shape, dtype=torch.float16, device=device) if codec.asym else None)

    (ks, kz), (vs, vz) = params(key_codec, head_dim), params(value_codec, Dv)
    codes = (torch.zeros((num_pages, H, P * D // 2), dtype=torch.uint8, device=device) for D in (head_dim, Dv))
    return PagedKV(next(codes), ks, kz, next(codes), vs, vz, key_codec.with_backend("triton"),
                   value_codec.with_backend("triton"), P)


def write(pool: PagedKV, pages: Sequence[int], keys: Packed, values: Packed) -> None:
    """Put the tokens of ``keys`` and ``values`` (the Triton backend's records of [Hkv, S, D] or [1, Hkv, S, D],
    encoded with the pool's codecs, S <= len(pages) x page_tokens, starting on a page) into ``pages``: page
    ``pages[j]`` gets tokens [j P, (j + 1) P). A partial last page holds its tokens first; write it again, whole,
    once it fills (its groups re-encoded then, as the sequence encoded whole would have them)."""
    torch = _torch()
    P, H = pool.page_tokens, pool.kv_heads
    for rec, codec, what, D in ((keys, pool.key_codec, "keys", pool.head_dim),
                                (values, pool.value_codec, "values", pool.value_dim)):
        shape = tuple(rec.shape)
        if len(shape) not in (3, 4) or shape[-3] != H or shape[-1] != D or (len(shape) == 4 and shape[0] != 1):
            raise CodecError(f"paged store: {what} of shape {list(shape)} do not fit pages of {H} KV heads x head dim "
                             f"{D}: pass one sequence, [Hkv, S, D] or [1, Hkv, S, D]")
        if not is_tensor(rec.codes) or rec.codes.device != pool.key_codes.device:
            raise CodecError(f"paged store: the {what} record must be on the pool's device "
                             f"({pool.key_codes.device}); encode with backend='triton' there")
        if rec.config.get("sinks"):
            raise CodecError(f"paged store: the {what} record keeps exact sink tokens; encode it with sinks=0")
    S = keys.shape[-2]
    if values.shape[-2] != S or S > len(pages) * P:
        raise CodecError(f"paged store: {S} key and {values.shape[-2]} value tokens for {len(pages)} pages of {P}")
    bad = [p for p in pages if not 0 <= int(p) < pool.num_pages]
    if bad:
        raise CodecError(f"paged store: page {bad[0]} is not in the pool of {pool.num_pages} pages")
    whole = S // P   # pages filled: one copy a buffer for all of them; a partial last page after them
    index = torch.as_tensor([int(p) for p in pages[:whole]], dtype=torch.long, device=pool.key_codes.device)
    for rec, codec, codes, scales, zeros, D in ((keys, pool.key_codec, pool.key_codes, pool.key_scales,
                                                 pool.key_zeros, pool.head_dim),
                                                (values, pool.value_codec, pool.value_codes, pool.value_scales,
                                                 pool.value_zeros, pool.value_dim)):
        span = gpu_attn.span_of(rec, codec.with_backend("triton"))
        G = codec.group_size
        per = P // G if codec.axis == "channel" else P * D // G     # a page's scale columns (blocks)
        bufs = [(codes, span.codes, P * D // 2)] + [(dst, src, per) for dst, src in ((scales, span.scales),
                                                                                      (zeros, span.zeros))
                                                     if dst is not None]
        for dst, src, width in bufs:
            if whole:
                dst[index] = src[:, :whole * width].reshape(H, whole, width, *src.shape[2:]).transpose(0, 1)
            if S > whole * P:   # the partial page: its tokens' bytes, its groups (the last one partial)
                n = S - whole * P
                used = n * D // 2 if dst is codes else \
                    -(-n // G) if codec.axis == "channel" else -(-n * D // G)
                dst[int(pages[whole]), :, :used] = src[:, whole * width:whole * width + used]


def encode_step(codec: Codec, residual, codes, scales, zeros, flag, new, where) -> None:
    """One decode step's keys or values into rows that hold whole residuals a slab (a static cache's: a page a batch
    row as long as its capacity, :mod:`kvcx.cache.static_cache`), in one launch and no host sync: ``new`` [B, Hkv, 1,
    D] (the residual's dtype, contiguous) is written into ``residual`` [B, Hkv, S, D] at token ``where[0]``
    (``where``: int64 [2] on the device, the slot and a part) and, where that fills it (slot S - 1), the residual is
    encoded by ``codec`` (4 bits, no sinks) into part ``where[1]`` of ``codes``, ``scales`` and ``zeros`` (None
    without zero points): buffers of a whole number of the residual's layouts a slab ([B x Hkv, parts, a residual's
    bytes or parameters]). Otherwise nothing is encoded: the launch is the same at every step, as a CUDA graph
    replays it. ``flag`` int32 [2] is set where the token holds NaN or Inf or an encoded group's scale is not
    finite, read when the caller chooses."""
    torch = _torch()
    dt, lay = gpu.dtype_name_of(residual), codec.layout(tuple(residual.shape), "residual")
    parts = codes.numel() // max(1, lay.codes_nbytes) if is_tensor(codes) else 0
    sizes = [(codes, lay.codes_nbytes * parts), (flag, 2)] + [(t, math.prod(lay.scale_shape) * parts)
                                                              for t in (scales, zeros) if t is not None]
    if codec.bits != 4 or codec.sinks or dt is None or not residual.is_contiguous() or parts < 1 or \
            (zeros is None) == codec.asym or any(not is_tensor(t) or t.device != residual.device or t.numel() != n
                                                 for t, n in sizes):
        raise CodecError(f"paged decode step: the residual {list(residual.shape)} {residual.dtype} does not fit the "
                         "rows given (a contiguous float tensor, a 4-bit codec without sinks, rows of whole "
                         "residuals' bytes and parameters on its device)")
    if not (is_tensor(new) and is_tensor(where) and new.dtype == residual.dtype and new.is_contiguous() and
            tuple(new.shape) == (*residual.shape[:2], 1, residual.shape[3]) and where.dtype == torch.int64 and
            tuple(where.shape) == (2,) and new.device == where.device == residual.device):
        raise CodecError(f"paged decode step: the new token must be [{residual.shape[0]}, {residual.shape[1]}, 1, "
                         f"{residual.shape[3]}] in {residual.dtype} (contiguous) and where int64 [2] (slot, part), "
                         f"both on {residual.device}")
    gpu.launch_encode(codec, lay, residual.view(lay.N, lay.S, lay.D), dt, codes, scales, zeros, flag,
                      step=(where, parts, new))


def attend(q, pool: PagedKV, block_table, seq_lens, scaling: Optional[float] = None,
           per_split: Optional[int] = None, sinks=(None, None), residual=(None, None), residual_lens=None, out=None,
           sink_logits=None, softcap: float = 0.0, mask=None, launch=None):
    """One decode step over a paged store: q [B, Hq, D] (one token a row, any float dtype), ``block_table`` int32
    [B, max_pages] (row b's pages in order; entries past its tokens are not read), ``seq_lens`` int32 [B] (row b's
    tokens, 0 to max_pages x page_tokens), both on the pool's device. Query head j reads KV head j // (Hq / Hkv).
    Exact tokens in the same softmax, optional: ``sinks`` (keys, values) [B, Hkv, t0, D] before the pages, and
    ``residual`` (keys, values) [B, Hkv, nr, D] after them, of which row b's first ``residual_lens[b]`` (int32
    [B] on the device; None: all nr) are tokens; both as the model holds them (any float dtype).
    Returns [B, Hq, D] float32 (NaN for a row of no token, as SDPA gives for a row with nothing to attend to), or
    writes it into ``out`` (the caller's [B, Hq, D], contiguous: float32, float16 or bfloat16, rounded to nearest
    even as ``.to`` rounds) and returns that.
    ``sink_logits`` float32 [Hq] on the device (each query head's sink logit, GPT-OSS's s_aux) or None; ``softcap``
    > 0: scores capped to softcap tanh(s / softcap) (Gemma 2), in both kernels. ``mask``: float32 [B, max_pages x
    page_tokens] on the device (a row's may be shared: stride 0 along the batch), added to the scores of the packed
    tokens in table order (0 or -inf: a sliding window's ring, :mod:`kvcx.cache.static_layers`), or None.
    ``launch``: how the kernels launch (:class:`kvcx.codecs.gpu_attn.LaunchSettings`; None: the defaults).
    No host sync: the splits are sized from the table's width, the lengths are read on the device (a step can be
    replayed from a CUDA graph)."""
    torch, launch = _torch(), gpu_attn.launch_settings(launch)
    B, Hq, D = q.shape
    H, P = pool.kv_heads, pool.page_tokens
    dev = pool.key_codes.device
    if D != pool.head_dim or D != pool.value_dim or Hq % H:
        raise CodecError(f"paged attention: q {list(q.shape)} does not fit pages of {H} KV heads x head dim "
                         f"{pool.head_dim} (values {pool.value_dim}: the kernel reads keys and values of one width)")
    for t, name, dims in ((block_table, "block_table", 2), (seq_lens, "seq_lens", 1)):
        if not is_tensor(t) or t.dtype != torch.int32 or t.dim() != dims or t.shape[0] != B or t.device != dev \
                or q.device != dev:
            raise CodecError(f"paged attention: {name} must be an int32 tensor of {dims} dims, batch {B} first, "
                             f"on {dev} with q (engines' shape: block_table [B, max_pages], seq_lens [B])")
    kc, vc = pool.key_codec, pool.value_codec
    N, R = B * H, Hq // H
    exact = [_exact(t, name, B, H, D, dev) for t, name in zip(sinks + residual, ("sink keys", "sink values",
                                                                                   "residual keys", "residual values"))]
    if (exact[0] is None) != (exact[1] is None) or (exact[2] is None) != (exact[3] is None) or \
            any(a is not None and a.shape != b.shape for a, b in (exact[:2], exact[2:])):
        raise CodecError("paged attention: give the sinks' (and the residual's) keys and values alike, [B, Hkv, n, D] "
                         "each, or neither")
    if residual_lens is not None and (exact[2] is None or not is_tensor(residual_lens) or
                                      residual_lens.dtype != torch.int32 or tuple(residual_lens.shape) != (B,) or
                                      residual_lens.device != dev):
        raise CodecError(f"paged attention: residual_lens must be an int32 tensor [{B}] on {dev}, with a residual")
    if mask is not None and (not is_tensor(mask) or mask.dtype != torch.float32 or
                             tuple(mask.shape) != (B, block_table.shape[1] * P) or mask.stride(1) != 1 or
                             mask.device != dev):
        raise CodecError(f"paged attention: mask must be a float32 tensor [{B}, {block_table.shape[1] * P}] (the "
                         f"table's tokens, unit stride along them) on {dev}, or None")
    rows = gpu.query_rows(q, N)
    scaling = D ** -0.5 if scaling is None else float(scaling)
    qr = gpu_attn.rotated_query(rows, scaling) if kc.rotate else None
    table = block_table.contiguous()
    const = gpu_attn.attention_constexprs(kc, vc, R, D, mask is not None, launch, gpu_attn.ptx_codes(q, launch),
                                          gpu_attn.dependent_merge(q, launch), page=P, softcap=softcap)
    per = gpu_attn.split_tokens(N, table.shape[1] * P, per_split, launch)
    nsp = max(1, -(-(table.shape[1] * P) // per))
    m, l, acc = (torch.empty(N, nsp, R, *d, device=dev) for d in ((), (), (D,)))
    bufs = (pool.key_codes, pool.key_scales, pool.key_zeros if pool.key_zeros is not None else pool.key_scales,
            pool.value_codes, pool.value_scales,
            pool.value_zeros if pool.value_zeros is not None else pool.value_scales)
    # the spans' integers are not read in the PAGE mode (a tile's page and a row's tokens come from the table)
    gpu_attn.launch_attention((N, nsp), qr if kc.rotate else rows, 1.0 if kc.rotate else scaling, bufs + bufs,
                              (0,) * 12, (m, l, acc), H, per, nsp, 0, {**const, "PAGE": P}, add=mask,
                              pages=(table, seq_lens), launch=launch)
    if sink_logits is not None and (not is_tensor(sink_logits) or sink_logits.dtype != torch.float32
                                    or tuple(sink_logits.shape) != (Hq,) or sink_logits.device != dev):
        raise CodecError(f"paged attention: sink_logits must be a float32 tensor [{Hq}] on {dev} (one logit a query "
                         "head)")
    return gpu_attn.merge_splits(rows, scaling, m, l, acc, H, vc.rotate, tuple(exact[:2]), tuple(exact[2:]),
                            res_lens=residual_lens, out=out, sink_logits=sink_logits,
                            softcap=softcap, launch=launch).reshape(B, Hq, D)


def _exact(t, name: str, B: int, H: int, D: int, dev):
    """Exact tokens [B, Hkv, n, D] as the merge reads them ([B x Hkv, n, D], contiguous), or None."""
    if t is None:
        return None
    if not is_tensor(t) or t.dim() != 4 or tuple(t.shape[:2]) != (B, H) or t.shape[3] != D or t.device != dev or \
            not t.is_floating_point():
        raise CodecError(f"paged attention: {name} must be a float tensor [{B}, {H}, n, {D}] on {dev}, got "
                         f"{list(getattr(t, 'shape', ()))}")
    return t.reshape(B * H, t.shape[2], D).contiguous()
