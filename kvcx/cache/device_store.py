"""A layer's packed store on the device (torch tensors, the Triton backend) and the fused decode step over it.

The device counterpart of :mod:`kvcx.cache.store`: :class:`DevicePackedKV` keeps one layer's packed keys and
values where the model runs (a CUDA GPU; a CPU tensor when the Triton backend is forced, in Triton's
interpreter), appends the chunks the Triton encoder writes, and attends over them with the Triton kernels of
:func:`kvcx.codecs.gpu_attn.attend_spans` (flash-decoding along the context; the exact sinks and the residual in the
same softmax). Nothing crosses to the host.

Chunks that continue one another (the same codecs, the last chunk ending on whole groups) are kept in one
*segment*: growing buffers per slab (batch row x KV head) that the kernel reads as one span. A chunk that
cannot continue (the first chunk after the sinks ends in a partial channel block) starts the next segment;
a step runs the kernel once per segment (two in practice) and one merge kernel over them in FP32.
"""
from __future__ import annotations

import math
from typing import Callable, Dict, List, NamedTuple, Optional

import torch

from kvcx.codecs import gpu, gpu_attn
from kvcx.codecs.backends import TRITON, backend_name
from kvcx.codecs.base import Codec, Packed, get_codec
from kvcx.errors import CodecError

BACKEND = TRITON
# a segment's buffers grow by at least this fraction of what they hold (and to whole groups of 64 tokens):
# appends copy the segment about 1 / GROWTH times over in all, and hold at most GROWTH more than they use
GROWTH = 1 / 8
_TOKEN_UNIT = 64


def decodes_on_device(key: Codec, value: Codec, device: torch.device, same_width: bool = True) -> bool:
    """Whether a layer with these codecs keeps its packed records on ``device`` and decodes them there with the Triton
    kernels (:class:`DeviceChunkKV`): both codecs are worked there (:func:`kvcx.codecs.backends.backend_name`: CUDA
    and a codec with a Triton backend, E8P and widths keys included, or ``backend="triton"``) but the fused attention
    does not read them both (:func:`runs_on_device` is false: kvcx2v, kvcx4w, the guard's 8-bit keys) or not at
    their widths (``same_width`` false: keys and values of different widths, MLA's latent and RoPE key)."""
    return all(backend_name(c, device.type) == BACKEND for c in (key, value)) and (
        not same_width or not runs_on_device(key, value, device))


def runs_on_device(key: Codec, value: Codec, device: torch.device) -> bool:
    """Whether a layer with these codecs keeps its packed store on ``device`` with the Triton backend: both
    codecs are worked there on it (named, ``backend="triton"``, or chosen by the device: CUDA, 4-bit codes,
    triton installed; :func:`kvcx.codecs.backends.backend_name`) and the fused attention reads their records there
    (:func:`kvcx.codecs.gpu_attn.reads`). Otherwise the store is the CPU one."""
    return all(backend_name(c, device.type) == BACKEND and gpu_attn.reads(c) for c in (key, value))


def _on_backend(held: Dict[tuple, Codec], config: dict) -> Codec:
    """The codec of ``config`` on the Triton backend, made once per config and kept in ``held``."""
    k = tuple(sorted((n, repr(v)) for n, v in config.items()))
    if k not in held:
        held[k] = get_codec(config).with_backend(BACKEND)
    return held[k]


def attend_in_dtype(query: torch.Tensor, attend: Callable[[Optional[torch.Tensor]], torch.Tensor]) -> torch.Tensor:
    """A decode step's attention [B, 1, Hq, D] in the query's dtype (the query [B, Hq, 1, D]): ``attend(out)`` is
    handed a [B, Hq, D] buffer of that dtype, which the merge kernel writes itself (no conversion launched after
    it), or None for a dtype it does not write (its FP32 result is converted then)."""
    B, Hq, _, D = query.shape
    if not gpu.merge_writes(query.dtype):
        return attend(None).to(query.dtype).view(B, 1, Hq, D)
    out = torch.empty(B, 1, Hq, D, dtype=query.dtype, device=query.device)
    attend(out.view(B, Hq, D))
    return out


class _Span:
    """One kind's packed tokens of a segment: growing codes [N, bytes], scales and zero points."""

    def __init__(self, codec: Codec, N: int, D: int, device):
        self.codec, self.N, self.D, self.device = codec, N, D, device
        self.tokens = 0
        self.capacity = 0
        self.codes = torch.empty((N, 0), dtype=torch.uint8, device=device)
        self.scales = self.zeros = None
        G = codec.group_size
        per = G if codec.axis == "channel" else G // math.gcd(G, D)   # tokens of a whole number of groups
        self.unit = per * _TOKEN_UNIT // math.gcd(per, _TOKEN_UNIT)

    def _groups(self, tokens: int) -> int:
        """Scale columns (per-token groups) or blocks (per-channel groups) of ``tokens`` whole-group tokens."""
        G = self.codec.group_size
        return tokens // G if self.codec.axis == "channel" else tokens * self.D // G

    def ends_whole(self) -> bool:
        G = self.codec.group_size
        return (self.tokens % G == 0) if self.codec.axis == "channel" else (self.tokens * self.D % G == 0)

    def _grow(self, need: int) -> None:
        cap = max(need, self.capacity + int(self.capacity * GROWTH))
        cap = -(-cap // self.unit) * self.unit
        codes = torch.empty((self.N, cap * self.D // 2), dtype=torch.uint8, device=self.device)
        codes[:, :self.codes.shape[1]] = self.codes
        tail = (self.D,) if self.codec.axis == "channel" else ()
        scales = torch.empty((self.N, self._groups(cap)) + tail, dtype=torch.float16, device=self.device)
        zeros = torch.empty_like(scales) if self.codec.asym else None
        if self.scales is not None:
            n = self.scales.shape[1]
            scales[:, :n] = self.scales
            if zeros is not None:
                zeros[:, :n] = self.zeros
        self.codes, self.scales, self.zeros, self.capacity = codes, scales, zeros, cap

    def append(self, p: Packed, T: int) -> None:
        """Write a chunk's T packed tokens after the held ones (they start on a whole group)."""
        if self.tokens + T > self.capacity:
            self._grow(self.tokens + T)
        a = self.tokens * self.D // 2
        codes = p.codes.view(self.N, -1)
        self.codes[:, a:a + codes.shape[1]] = codes
        g = self._groups(self.tokens)
        s = p.scales.view(self.N, -1, self.D) if self.codec.axis == "channel" else p.scales.view(self.N, -1)
        self.scales[:, g:g + s.shape[1]] = s
        if self.zeros is not None:
            self.zeros[:, g:g + s.shape[1]] = p.zeros.view(s.shape)
        self.tokens += T

    def drop_front(self, T: int) -> None:
        """Drop the first T packed tokens (whole groups), the rest moved to the front of the buffers in place."""
        if T <= 0:
            return
        rest = self.tokens - T
        a, b = T * self.D // 2, self.tokens * self.D // 2
        self.codes[:, :b - a] = self.codes[:, a:b].clone()
        g0, g1 = self._groups(T), self._groups(self.tokens)
        for t in (self.scales, self.zeros):
            if t is not None and g1 > g0:
                t[:, :g1 - g0] = t[:, g0:g1].clone()
        self.tokens = rest

    def span(self) -> gpu_attn.PackedSpan:
        """What the attention kernel reads (the buffers whole: rows as long as the capacity)."""
        return gpu_attn.PackedSpan(self.codes, self.scales, self.zeros, self.tokens)

    def record(self, lead: tuple, dtype: str) -> Packed:
        """The held tokens as a record of [*lead, tokens, D] (copies), to decode."""
        lay = self.codec.layout(tuple(lead) + (self.tokens, self.D), "span")
        nb = lay.codes_nbytes // self.N
        cols = lay.scale_shape[1]
        return Packed(codes=self.codes[:, :nb].contiguous().view(-1), scales=self.scales[:, :cols].contiguous(),
                      zeros=None if self.zeros is None else self.zeros[:, :cols].contiguous(), sinks=None,
                      shape=tuple(lead) + (self.tokens, self.D), dtype=dtype, config=self.codec.get_config(),
                      meta={"partial_group": lay.partial_group})

    @property
    def nbytes(self) -> int:
        return int(sum(a.numel() * a.element_size() for a in (self.codes, self.scales, self.zeros) if a is not None))


class _Segment:
    """Chunks that continue one another: keys and values from packed token ``start`` (after the sinks)."""

    def __init__(self, kc: Codec, vc: Codec, N: int, D: int, device, start: int, dtype: str):
        self.keys, self.values = _Span(kc, N, D, device), _Span(vc, N, D, device)
        self.start, self.dtype = start, dtype

    def continues(self, kc: Codec, vc: Codec, dtype: str) -> bool:
        return (kc is self.keys.codec and vc is self.values.codec and dtype == self.dtype
                and self.keys.ends_whole() and self.values.ends_whole())


class DevicePackedKV:
    """One layer's packed keys and values on the device, and the fused decode step over them (the device
    counterpart of :class:`kvcx.cache.store.PackedKV`, with the same questions answered: tokens, chunks,
    bytes, why a step cannot run fused)."""

    def __init__(self, B: int, H: int, D: int, device):
        self.B, self.H, self.D, self.N, self.device = B, H, D, B * H, device
        self.sinks: Dict[str, Optional[torch.Tensor]] = {"key": None, "value": None}   # [N, t0, D] as written
        self.segments: List[_Segment] = []
        self.chunks = 0
        self._chunk_tokens: List[int] = []   # packed tokens of each chunk held (after the sinks)
        self._codecs: Dict[tuple, Codec] = {}

    def __len__(self) -> int:
        return self.chunks

    def _t0(self, kind: str) -> int:
        s = self.sinks[kind]
        return 0 if s is None else int(s.shape[1])

    @property
    def tokens(self) -> int:
        """Tokens held (sinks included)."""
        seg = self.segments[-1] if self.segments else None
        return self._t0("key") + (seg.start + seg.keys.tokens if seg else 0)

    def _codec(self, config: dict) -> Codec:
        """The codec of a chunk's config, without sinks, on the Triton backend (one object per config)."""
        return _on_backend(self._codecs, {**config, "sinks": 0})

    def append(self, pk: Packed, pv: Packed) -> None:
        """Add the Triton encoder's records of a chunk [B, H, S, D] (only the first may hold sinks)."""
        if tuple(pk.shape) != tuple(pv.shape) or tuple(pk.shape[:2]) != (self.B, self.H) or pk.shape[-1] != self.D:
            raise CodecError(f"packed keys {list(pk.shape)} and values {list(pv.shape)} do not fit this store "
                             f"([{self.B}, {self.H}, *, {self.D}])")
        S = int(pk.shape[-2])
        t0 = {kind: int(p.config.get("sinks", 0)) for kind, p in (("key", pk), ("value", pv))}
        if any(t0.values()):
            if self.chunks:
                raise CodecError("only the first packed chunk may hold exact sink tokens")
            for kind, p in (("key", pk), ("value", pv)):
                if t0[kind]:
                    self.sinks[kind] = p.sinks.reshape(self.N, t0[kind], self.D).contiguous()
        kc, vc = self._codec(pk.config), self._codec(pv.config)
        seg = self.segments[-1] if self.segments else None
        if seg is None or not seg.continues(kc, vc, pk.dtype):
            start = seg.start + seg.keys.tokens if seg else 0
            seg = _Segment(kc, vc, self.N, self.D, self.device, start, pk.dtype)
            self.segments.append(seg)
        seg.keys.append(pk, S - t0["key"])
        seg.values.append(pv, S - t0["value"])
        self.chunks += 1
        self._chunk_tokens.append(S - t0["key"])

    def chunk_tokens(self, i: int) -> int:
        """Tokens of chunk i (sinks included)."""
        return self._chunk_tokens[i] + (self._t0("key") if i == 0 else 0)

    def drop_chunks(self, k: int) -> int:
        """Drop the first ``k`` chunks (a sliding window has left them; none may hold sinks): whole segments go,
        a segment the last of them ends in keeps its later tokens, moved to the front of its buffers. Returns the
        tokens dropped."""
        if k <= 0:
            return 0
        if k > self.chunks or (self._t0("key") or self._t0("value")):
            raise CodecError(f"cannot drop {k} of {self.chunks} packed chunks (a store with exact sink tokens keeps "
                             "them all)")
        gone = sum(self._chunk_tokens[:k])
        left = gone
        while left and self.segments:
            seg = self.segments[0]
            if seg.keys.tokens <= left:
                left -= seg.keys.tokens
                self.segments.pop(0)
            else:
                seg.keys.drop_front(left)
                seg.values.drop_front(left)
                left = 0
        start = 0
        for seg in self.segments:   # packed positions from the first held token on
            seg.start, start = start, start + seg.keys.tokens
        self.chunks -= k
        self._chunk_tokens = self._chunk_tokens[k:]
        return gone

    def unsupported(self, group: int) -> Optional[str]:
        """Why the Triton attention cannot read this store for ``group`` query heads per KV head (None: it can)."""
        D = self.D
        if D & (D - 1) or D < 16:
            return f"fused attention on the device needs a head dim that is a power of two from 16, got {D}"
        if self._t0("key") != self._t0("value"):
            return (f"fused attention on the device needs keys and values to keep the same sink tokens (keys "
                    f"{self._t0('key')}, values {self._t0('value')})")
        if group < 1:
            return "fused attention needs the query heads to be a multiple of the KV heads"
        if len({seg.values.codec.rotate for seg in self.segments}) > 1:
            return "fused attention on the device needs every packed chunk's values to rotate alike"
        return None

    def decode_into(self, kind: str, out: torch.Tensor) -> int:
        """Decode every held token of ``kind`` ("key" / "value") into ``out`` [B, H, >= tokens, D] (a tensor on
        the store's device, FP16, BF16 or FP32: the codes are decoded to its dtype, e.g. FP32 for a reference
        without the model dtype's rounding) from token 0; returns the tokens written."""
        dtype = gpu.dtype_name_of(out)
        if dtype is None:
            raise CodecError(f"decoding the store's {kind}s: out must be a float16, bfloat16 or float32 tensor, got "
                             f"{out.dtype}")
        t0 = self._t0(kind)
        if t0:
            out[:, :, :t0] = self.sinks[kind].view(self.B, self.H, t0, self.D)
        off = t0
        for seg in self.segments:
            span = seg.keys if kind == "key" else seg.values
            if span.tokens:
                span.codec.decode(span.record((self.B, self.H), dtype), out, name=kind, token_offset=off)
                off += span.tokens
        return off

    def attend(self, q: torch.Tensor, residual_k: torch.Tensor, residual_v: torch.Tensor,
               add: Optional[torch.Tensor], scaling: float, per_split: Optional[int] = None,
               out: Optional[torch.Tensor] = None, sink_logits: Optional[torch.Tensor] = None,
               softcap: float = 0.0, launch: Optional[gpu_attn.LaunchSettings] = None) -> torch.Tensor:
        """One decode step: q [B, Hq, D] (one token per row) against the held tokens, then the residual
        [B, H, nr, D] (the step's own token its last); ``add`` float32 [B, held + nr] added to the scores, or
        None. Returns [B, Hq, D] float32, or written into ``out`` (:func:`attend_in_dtype`'s, in its dtype). The
        caller checked :meth:`unsupported`. ``sink_logits`` float32 [Hq] on the device (per-head sinks) or None;
        ``softcap`` > 0: scores capped; ``launch``: how the kernels launch (None: the defaults)
        (:func:`kvcx.codecs.gpu_attn.attend_spans`)."""
        B, Hq, D = q.shape
        held, nr = self.tokens, residual_k.shape[2]
        t0 = self._t0("key")
        spans = [gpu_attn.Span(seg.keys.span(), seg.values.span(), seg.keys.codec, seg.values.codec, t0 + seg.start)
                 for seg in self.segments]
        sinks = (self.sinks["key"], self.sinks["value"]) if t0 else (None, None)
        residual = (residual_k.reshape(self.N, nr, D), residual_v.reshape(self.N, nr, D)) if nr else (None, None)
        return gpu_attn.attend_spans(gpu.query_rows(q, self.N), scaling, spans, self.H, sinks, residual, add, held,
                                per_split, out=out, sink_logits=sink_logits, softcap=softcap,
                                launch=launch).reshape(B, Hq, D)

    @property
    def nbytes(self) -> int:
        """Every tensor held: the segments' buffers (their capacity) and the sinks."""
        n = sum(seg.keys.nbytes + seg.values.nbytes for seg in self.segments)
        return int(n + sum(s.numel() * s.element_size() for s in self.sinks.values() if s is not None))



class _Chunk(NamedTuple):
    """A chunk's records as the encoder wrote them and their decoders (:meth:`Codec.decoder`)."""
    key: Packed
    value: Packed
    decode_key: Callable
    decode_value: Callable


class DeviceChunkKV:
    """One layer's packed keys and values on the device as the Triton encoder wrote them, chunk by chunk, for codecs
    that run on the device but that the fused attention does not read (:func:`decodes_on_device`): each step decodes
    them there into the layer's scratch and the model's attention reads it (a materialised step). Nothing crosses
    to the host; the same questions answered as :class:`DevicePackedKV` (tokens, chunks, bytes, why not fused)."""

    def __init__(self, B: int, H: int, key_codec: Codec, value_codec: Codec, device):
        self.B, self.H, self.device = B, H, device
        self._describe = f"{key_codec.describe()} / {value_codec.describe()}"
        self._chunks: List[_Chunk] = []
        self._codecs: Dict[tuple, Codec] = {}

    def __len__(self) -> int:
        return len(self._chunks)

    @property
    def tokens(self) -> int:
        """Tokens held (sinks included)."""
        return sum(int(c.key.shape[-2]) for c in self._chunks)

    def chunk_tokens(self, i: int) -> int:
        """Tokens of chunk i (sinks included)."""
        return int(self._chunks[i].key.shape[-2])

    def _codec(self, config: dict) -> Codec:
        """The codec of a record's config on the Triton backend (one object per config)."""
        return _on_backend(self._codecs, config)

    def append(self, pk: Packed, pv: Packed) -> None:
        """Add the Triton encoder's records of a chunk [B, H, S, D] (only the first may hold sinks)."""
        if tuple(pk.shape[:-1]) != tuple(pv.shape[:-1]) or tuple(pk.shape[:2]) != (self.B, self.H):
            raise CodecError(f"packed keys {list(pk.shape)} and values {list(pv.shape)} do not fit this store "
                             f"([{self.B}, {self.H}, *, *])")
        if self._chunks and (pk.config.get("sinks") or pv.config.get("sinks")):
            raise CodecError("only the first packed chunk may hold exact sink tokens")
        # each record checked once here; a step's decode launches its kernels and reads nothing back
        self._chunks.append(_Chunk(pk, pv, self._codec(pk.config).decoder(pk, "key"),
                                   self._codec(pv.config).decoder(pv, "value")))

    def drop_chunks(self, k: int) -> int:
        """Drop the first ``k`` chunks (a sliding window has left them; none may hold sinks). Returns the tokens
        dropped."""
        if k <= 0:
            return 0
        if k > len(self._chunks) or any(p.config.get("sinks") for p in (self._chunks[0].key, self._chunks[0].value)):
            raise CodecError(f"cannot drop {k} of {len(self._chunks)} packed chunks (a store with exact sink tokens "
                             "keeps them all)")
        gone = sum(self.chunk_tokens(i) for i in range(k))
        self._chunks = self._chunks[k:]
        return gone

    def unsupported(self, group: int) -> Optional[str]:
        """Why the fused attention cannot read this store: always (its codecs' records are decoded first)."""
        return (f"the fused attention on the device reads 4-bit integer codes; this layer's codecs ({self._describe}) "
                "run on the device's Triton kernels, so each step decodes its packed context there")

    def decode_into(self, kind: str, out: torch.Tensor) -> int:
        """Decode every held token of ``kind`` ("key" / "value") into ``out`` [B, H, >= tokens, D] (a contiguous
        float tensor on the store's device; the records decode to its dtype) from token 0; returns the tokens
        written."""
        dtype = gpu.dtype_name_of(out)
        if dtype is None:
            raise CodecError(f"decoding the store's {kind}s: out must be a float16, bfloat16 or float32 tensor, got "
                             f"{out.dtype}")
        off = 0
        for chunk in self._chunks:
            record, run = (chunk.key, chunk.decode_key) if kind == "key" else (chunk.value, chunk.decode_value)
            if record.dtype == dtype:
                run(out, off)
            else:   # a record decodes to its own dtype: seen as the out's (a reference in FP32), checked again
                self._codec(record.config).decode(Packed(**{**record.__dict__, "dtype": dtype}), out, name=kind,
                                                  token_offset=off)
            off += int(record.shape[-2])
        return off

    @property
    def nbytes(self) -> int:
        """Every tensor held: the records' codes, ranges or scales, zero points and sinks."""
        return int(sum(a.numel() * a.element_size() for c in self._chunks for p in (c.key, c.value)
                       for a in (p.codes, p.scales, p.zeros, p.sinks) if a is not None))
