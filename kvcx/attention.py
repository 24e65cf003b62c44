"""Attention straight from packed codes: a layer's growing packed store and the fused decode step.

NumPy and the kernels only (no torch): :mod:`kvcx.hf` wires this into transformers.

:class:`PackedStore` keeps one kind (keys or values) of one layer's packed chunks concatenated
per (batch row x KV head): codes ``[N, bytes]``, FP16 scales ``[N, nscale]`` (+ zero points),
the block starts of channel-grouped tokens, and each chunk's facts so that a chunk can still be
decoded on its own (the materialising path).

:class:`PackedKV` pairs a layer's key and value stores; its :meth:`PackedKV.attend` runs one decode step of one layer: every query head attends to the packed tokens
of its KV head (read once for the query heads that share it), the exact sink tokens and the
full-precision residual, in one softmax, without writing a dequantized key or value anywhere.
How the kernel works: ``kvcx/_attn.h``.
"""
from __future__ import annotations

import math
from typing import List, Optional

import numpy as np

from kvcx import _core
from kvcx.codec import IntCodec, Packed, decode_packed
from kvcx.errors import CodecError
from kvcx.runtime import resolve_threads

ATTN_MAX_GROUP = _core.ATTN_MAX_GROUP
ATTN_MAX_D = _core.ATTN_MAX_D
# tokens per task at least, when a (row x KV head) is split across threads
_MIN_SPLIT_TOKENS = 128
# below this many tokens of work per (row x KV head) (an exact token counting as 4 packed ones), one
# thread: waking a second one costs more than it saves, and its spinning competes with torch's threads
_MIN_PARALLEL_TOKENS = 2048


def fused_unsupported(key: IntCodec, value: IntCodec, head_dim: int, group: int) -> Optional[str]:
    """Why the fused kernel cannot serve these codecs (None when it can)."""
    if not (isinstance(key, IntCodec) and isinstance(value, IntCodec)):
        return "fused attention reads IntCodec codes (per-channel widths are decoded, then attended)"
    if key.bits != 4 or value.bits != 4:
        return f"fused attention reads 4-bit codes (keys {key.bits}, values {value.bits} bits)"
    if head_dim % 16 or head_dim > ATTN_MAX_D:
        return f"fused attention needs a head dim that is a multiple of 16 up to {ATTN_MAX_D}, got {head_dim}"
    if group < 1 or group > ATTN_MAX_GROUP:
        return f"fused attention serves 1 to {ATTN_MAX_GROUP} query heads per KV head, got {group}"
    if value.axis != "token":
        return "fused attention needs values grouped per token"
    for kind, c in (("key", key), ("value", value)):
        if c.axis == "token" and c.group_size % head_dim:
            return (f"fused attention needs per-token {kind} groups of whole tokens (group size {c.group_size} "
                    f"is not a multiple of head dim {head_dim})")
    return None


class PackedStore:
    """The packed tokens of one kind of one layer: chunks appended, kept concatenated per slab."""

    def __init__(self, N: int, D: int):
        self.N, self.D = int(N), int(D)
        self.codes = np.empty((self.N, 0), dtype=np.uint8)
        self.scales = np.empty((self.N, 0), dtype=np.float16)
        self.zeros: Optional[np.ndarray] = None
        self.block_starts = np.zeros(1, dtype=np.int64)   # channel grouping: packed tokens where blocks start
        self.sinks: Optional[np.ndarray] = None            # exact tokens of the first chunk [N, t0, D]
        self.tokens = 0                                     # packed (quantized) tokens per slab
        self.whole_groups = True   # per-token groups never straddle two chunks (the fused kernel needs it)
        self._chunks: List[dict] = []
        self._sinks_f32: Optional[np.ndarray] = None

    def __len__(self) -> int:
        return len(self._chunks)

    @property
    def sink_tokens(self) -> int:
        return 0 if self.sinks is None else int(self.sinks.shape[1])

    def append(self, p: Packed) -> None:
        """Add an encoded chunk (shape [..., S, D] with N slabs; only the first may hold sinks)."""
        cfg = p.config
        S, D = int(p.shape[-2]), int(p.shape[-1])
        N = p.numel // (S * D)
        t0 = int(cfg.get("sinks", 0))
        if N != self.N or D != self.D:
            raise CodecError(f"a packed chunk of shape {list(p.shape)} does not fit this store ({self.N} slabs of "
                             f"head dim {self.D})")
        if t0 and self._chunks:
            raise CodecError("only the first packed chunk may hold exact sink tokens")
        codes = p.codes.reshape(N, -1)
        scales = p.scales.reshape(N, -1)
        chunk = {"shape": tuple(p.shape), "dtype": p.dtype, "config": dict(cfg), "meta": dict(p.meta),
                 "codes": (self.codes.shape[1], self.codes.shape[1] + codes.shape[1]),
                 "scales": (self.scales.shape[1], self.scales.shape[1] + scales.shape[1])}
        self.codes = np.concatenate([self.codes, codes], axis=1)
        self.scales = np.concatenate([self.scales, scales], axis=1)
        if p.zeros is not None:
            z = p.zeros.reshape(N, -1)
            self.zeros = z.copy() if self.zeros is None else np.concatenate([self.zeros, z], axis=1)
        if cfg.get("axis") == "channel":
            G = int(cfg["group_size"])
            starts = self.tokens + np.arange(G, S - t0, G, dtype=np.int64)
            self.block_starts = np.concatenate([self.block_starts[:-1], [self.tokens], starts,
                                                [self.tokens + S - t0]]).astype(np.int64)
        if cfg.get("axis") == "token" and ((S - t0) * D) % int(cfg["group_size"]):
            self.whole_groups = False
        if t0:
            self.sinks = np.ascontiguousarray(p.sinks).reshape(N, t0, D)
            self._sinks_f32 = None
        self.tokens += S - t0
        self._chunks.append(chunk)

    def chunk(self, i: int) -> Packed:
        """Chunk i as a Packed of its own (copies of its slices), e.g. to decode it."""
        c = self._chunks[i]
        a, b = c["codes"]
        sa, sb = c["scales"]
        return Packed(codes=np.ascontiguousarray(self.codes[:, a:b]).reshape(-1),
                      scales=np.ascontiguousarray(self.scales[:, sa:sb]),
                      zeros=None if self.zeros is None else np.ascontiguousarray(self.zeros[:, sa:sb]),
                      sinks=self.sinks if c["config"].get("sinks", 0) else None,
                      shape=c["shape"], dtype=c["dtype"], config=c["config"], meta=c["meta"])

    def _mergeable(self, i: int, j: int) -> bool:
        """Whether chunk j can continue chunk i's tensor (same settings, no sinks, groups that end with i)."""
        a, b = self._chunks[i], self._chunks[j]
        if a["config"].get("id") != IntCodec.codec_id:  # other codecs' chunks are not laid out per slab
            return False
        if a["config"] != b["config"] or a["dtype"] != b["dtype"] or b["config"].get("sinks", 0):
            return False
        S, D = a["shape"][-2], a["shape"][-1]
        q = S - a["config"].get("sinks", 0)
        G = int(a["config"]["group_size"])
        return (q % G == 0) if a["config"]["axis"] == "channel" else ((q * D) % G == 0)

    def spans(self):
        """The chunks as few Packed tensors as possible: runs of chunks that continue one another merged
        (copies of their slices), each decodable on its own."""
        i = 0
        while i < len(self._chunks):
            j = i + 1
            while j < len(self._chunks) and self._mergeable(j - 1, j):
                j += 1
            if j == i + 1:
                yield self.chunk(i)
            else:
                first, last = self._chunks[i], self._chunks[j - 1]
                S = sum(int(c["shape"][-2]) for c in self._chunks[i:j])
                a, b = first["codes"][0], last["codes"][1]
                sa, sb = first["scales"][0], last["scales"][1]
                yield Packed(codes=np.ascontiguousarray(self.codes[:, a:b]).reshape(-1),
                             scales=np.ascontiguousarray(self.scales[:, sa:sb]),
                             zeros=None if self.zeros is None else np.ascontiguousarray(self.zeros[:, sa:sb]),
                             sinks=None, shape=tuple(first["shape"][:-2]) + (S, first["shape"][-1]),
                             dtype=first["dtype"], config=first["config"], meta=last["meta"])
            i = j

    def chunk_tokens(self, i: int) -> int:
        """Tokens of chunk i (sinks included)."""
        return int(self._chunks[i]["shape"][-2])

    def sinks_f32(self) -> Optional[np.ndarray]:
        if self.sinks is None:
            return None
        if self.sinks.dtype == np.float32:
            return self.sinks
        if self._sinks_f32 is None:
            self._sinks_f32 = self.sinks.astype(np.float32)
        return self._sinks_f32

    @property
    def nbytes(self) -> int:
        """Every array this store holds."""
        arrays = [self.codes, self.scales, self.zeros, self.block_starts, self.sinks,
                  self._sinks_f32 if self._sinks_f32 is not self.sinks else None]
        return int(sum(a.nbytes for a in arrays if a is not None))


_EMPTY_U16 = np.empty((0, 0), dtype=np.uint16)
_EMPTY_F32_2 = np.empty((0, 0), dtype=np.float32)
_EMPTY_F32_3 = np.empty((0, 0, 0), dtype=np.float32)
_EMPTY_I64 = np.empty(0, dtype=np.int64)
NO_MASK = _EMPTY_F32_2   # PackedKV.step's mask argument when nothing is masked


def _splits(slabs: int, tokens: int, threads: int) -> int:
    """Token ranges per slab: enough tasks to keep every thread busy, in whole-thread multiples."""
    if threads <= 1:
        return 1
    n = threads // math.gcd(slabs, threads)
    while slabs * n < 2 * threads:
        n *= 2
    return max(1, min(n, tokens // _MIN_SPLIT_TOKENS))


class Workspace:
    """The fused kernel's scratch floats, which the layers of one cache can share (one runs at a time)."""

    def __init__(self):
        self.array = _EMPTY_F32_2

    def get(self, rows: int, cols: int) -> np.ndarray:
        if self.array.shape[0] < rows or self.array.shape[1] != cols:
            self.array = np.empty((max(rows, self.array.shape[0] if self.array.shape[1] == cols else 0), cols),
                                  dtype=np.float32)
        return self.array

    @property
    def nbytes(self) -> int:
        return int(self.array.nbytes)


class PackedKV:
    """One layer's packed keys and values, and the fused decode step over them.

    ``key_codec`` / ``value_codec``: the codecs of the first chunk (their sinks say how many leading
    tokens are exact); later chunks are appended without sinks. The leading tokens that either kind
    keeps exact form the *head*: attention reads them as float32 rows (exact where kept exact, decoded
    where packed: the same values the materialising path decodes), and the packed stores from there on.
    """

    def __init__(self, N: int, D: int, key_codec: IntCodec, value_codec: IntCodec,
                 workspace: Optional[Workspace] = None):
        self.keys = PackedStore(N, D)
        self.values = PackedStore(N, D)
        self.key_codec, self.value_codec = key_codec, value_codec
        self._head = None
        self._why = {}          # (head dim, group) -> why the kernel cannot read the stores (None: it can)
        # the kernel's workspace, kept between steps: this store's own (counted in nbytes) or a shared one
        self._own_workspace = workspace is None
        self.workspace = workspace if workspace is not None else Workspace()
        self._plan_obj, self._plan_key, self._plan_work = None, None, None

    def __len__(self) -> int:
        return len(self.keys)

    @property
    def tokens(self) -> int:
        """Tokens held (sinks included)."""
        return self.keys.tokens + self.keys.sink_tokens

    def append(self, pk: Packed, pv: Packed) -> None:
        if tuple(pk.shape) != tuple(pv.shape):
            raise CodecError(f"packed keys {list(pk.shape)} and values {list(pv.shape)} differ in shape")
        self.keys.append(pk)
        self.values.append(pv)

    def unsupported(self, head_dim: int, group: int) -> Optional[str]:
        """Why the fused kernel cannot read these stores (None when it can)."""
        if not (self.keys.whole_groups and self.values.whole_groups):
            return "fused attention needs per-token groups that end with each packed chunk"
        k = (head_dim, group)
        if k not in self._why:
            self._why[k] = fused_unsupported(self.key_codec, self.value_codec, head_dim, group)
        return self._why[k]

    def head(self):
        """(keys, values) of the leading tokens either kind keeps exact, float32 [N, n, D] (cached)."""
        n = max(self.keys.sink_tokens, self.values.sink_tokens)
        if self._head is None or self._head[0].shape[1] != n:
            rows = []
            for store in (self.keys, self.values):
                if n == 0:
                    rows.append(np.empty((store.N, 0, store.D), dtype=np.float32))
                elif store.sink_tokens >= n:
                    rows.append(np.ascontiguousarray(store.sinks_f32()[:, :n]))
                else:  # packed there: decode the first chunk once and keep its first n tokens
                    full = decode_packed(store.chunk(0), name="head").astype(np.float32, copy=False)
                    rows.append(np.ascontiguousarray(full.reshape(store.N, -1, store.D)[:, :n]))
            self._head = (rows[0], rows[1])
        return self._head

    @property
    def nbytes(self) -> int:
        """Every array held: both stores and the cached head rows."""
        n = self.keys.nbytes + self.values.nbytes + (self.workspace.nbytes if self._own_workspace else 0)
        if self._head is not None:
            for a, store in zip(self._head, (self.keys, self.values)):
                if store.sinks is None or not np.shares_memory(a, store.sinks):
                    n += a.nbytes
        return int(n)

    def _plan(self, B: int, Hkv: int, R: int, D: int, threads: int):
        """The kernel's plan for this geometry, bound to the stores as they are now (rebuilt on change: new
        chunks, another geometry, or the shared workspace reallocated by another layer)."""
        key = (B, Hkv, R, D, threads, len(self.keys._chunks))
        if self._plan_key == key and self.workspace.array is self._plan_work:
            return self._plan_obj
        nh = max(self.keys.sink_tokens, self.values.sink_tokens)  # the head rows: exact in either kind
        Tq = self.tokens - nh                                       # positions read from the packed codes
        nsplit = _splits(B * Hkv, Tq, threads)
        work = self.workspace.get(B * Hkv * nsplit, _core.attn_work_floats(R, D))
        kc, vc = self.key_codec, self.value_codec
        plan = _core.AttnPlan(B=B, Hkv=Hkv, R=R, D=D,
                              k_axis=_core.AXIS_CHANNEL if kc.axis == "channel" else _core.AXIS_TOKEN,
                              k_asym=kc.asym, k_rotate=kc.rotate, k_group=kc.group_size,
                              v_asym=vc.asym, v_rotate=vc.rotate, v_group=vc.group_size)
        hk, hv = self.head()
        keys, values = self.keys, self.values
        plan.bind(keys.codes, keys.scales.view(np.uint16),
                  keys.zeros.view(np.uint16) if keys.zeros is not None else _EMPTY_U16,
                  keys.block_starts if kc.axis == "channel" else _EMPTY_I64,
                  values.codes, values.scales.view(np.uint16),
                  values.zeros.view(np.uint16) if values.zeros is not None else _EMPTY_U16,
                  hk, hv, Tq, work, nsplit)
        self._plan_obj, self._plan_key, self._plan_work = plan, key, work
        return self._plan_obj

    def attend(self, q: np.ndarray, residual_k: Optional[np.ndarray], residual_v: Optional[np.ndarray],
               mask: Optional[np.ndarray], scaling: float, n_threads: Optional[int] = None,
               out: Optional[np.ndarray] = None) -> np.ndarray:
        """One decode step: every query attends to the held tokens, then the residual.

        q: [B, Hq, D] float32 queries (one token per row); residual_k/v: [B, Hkv, nr, D] float32, the
        full-precision tokens after the packed ones (the new token last) or None; mask: [B, kv_len]
        float32 added to the scores (0 = attend, -inf = masked), kv_len = held + residual tokens.
        Returns out: [B, Hq, D] float32 (``out=`` to reuse an array).
        """
        if not (isinstance(q, np.ndarray) and q.dtype == np.float32 and q.ndim == 3 and q.flags.c_contiguous):
            raise CodecError(f"attention: q must be a C-contiguous float32 [B, Hq, D] array, got "
                             f"{getattr(q, 'dtype', type(q).__name__)} {list(getattr(q, 'shape', ()))}")
        B, Hq, D = q.shape
        N = self.keys.N
        if self.keys.D != D or N % B or Hq % (N // B):
            raise CodecError(f"attention: q {list(q.shape)} does not fit the packed stores ({N} rows x KV heads "
                             f"of head dim {self.keys.D})")
        Hkv = N // B
        R = Hq // Hkv
        why = self.unsupported(D, R)
        if why:
            raise CodecError(why)
        held = self.tokens
        if self.values.tokens + self.values.sink_tokens != held:
            raise CodecError(f"attention: {held} key tokens but {self.values.tokens + self.values.sink_tokens} "
                             "value tokens")
        rk, rv, nr = _EMPTY_F32_3, _EMPTY_F32_3, 0
        if residual_k is not None or residual_v is not None:
            rk, rv = residual_k, residual_v
            if not (isinstance(rk, np.ndarray) and isinstance(rv, np.ndarray) and rk.dtype == rv.dtype == np.float32
                    and rk.shape == rv.shape and rk.ndim == 4 and rk.shape[:2] == (B, Hkv) and rk.shape[3] == D
                    and rk.flags.c_contiguous and rv.flags.c_contiguous):
                raise CodecError(f"attention: the residual must be C-contiguous float32 [B={B}, Hkv={Hkv}, n, "
                                 f"D={D}] keys and values of the same shape")
            nr = rk.shape[2]
            rk, rv = rk.reshape(N, nr, D), rv.reshape(N, nr, D)
        kv_len = held + nr
        if kv_len == 0:
            raise CodecError("attention: there are no tokens to attend to")
        if mask is None:
            mask = _EMPTY_F32_2
        elif not (isinstance(mask, np.ndarray) and mask.dtype == np.float32 and mask.flags.c_contiguous
                  and mask.shape == (B, kv_len)):
            raise CodecError(f"attention: mask must be a C-contiguous float32 [B={B}, kv_len={kv_len}] array, "
                             f"got {getattr(mask, 'dtype', type(mask).__name__)} {list(getattr(mask, 'shape', ()))}")
        if out is None:
            out = np.empty((B, Hq, D), dtype=np.float32)
        elif not (isinstance(out, np.ndarray) and out.dtype == np.float32 and out.shape == (B, Hq, D)
                  and out.flags.c_contiguous and out.flags.writeable):
            raise CodecError(f"attention: out must be a writeable C-contiguous float32 array of shape {[B, Hq, D]}")
        return self.step(q, rk, rv, mask, scaling, resolve_threads(n_threads), out)

    def step(self, q: np.ndarray, rk: np.ndarray, rv: np.ndarray, mask: np.ndarray, scaling: float, threads: int,
             out: np.ndarray) -> np.ndarray:
        """One decode step for a caller that built every array itself (:meth:`attend` after its checks,
        :mod:`kvcx.hf` per layer step): q and out [B, Hq, D], rk / rv [N, nr, D] (nr may be 0), mask [B, held + nr] or ``NO_MASK``, all float32 and C-contiguous (the kernel's typed
        arguments refuse anything else). Only the sizes the kernel indexes by are checked here: a decode step
        runs once per layer and token, and the per-call checks cost as much as the kernel on short contexts."""
        B, Hq, D = q.shape
        N, nr, held = self.keys.N, rk.shape[1], self.tokens
        if (not B or D != self.keys.D or N % B or Hq % (N // B) or (nr and rk.shape != (N, nr, D))
                or rv.shape != rk.shape or out.shape != q.shape or (mask.shape[0] and mask.shape != (B, held + nr))
                or held + nr == 0):
            raise CodecError(f"attention: q {list(q.shape)}, residual {list(rk.shape)} / {list(rv.shape)}, mask "
                             f"{list(mask.shape)}, out {list(out.shape)} do not fit the packed stores ({N} rows x KV "
                             f"heads of head dim {self.keys.D}, {held} tokens)")
        if held + 4 * nr < _MIN_PARALLEL_TOKENS:
            threads = 1
        self._plan(B, N // B, Hq // (N // B), D, threads).run(q, rk, rv, mask, out, scaling, threads)
        return out
