"""A layer's growing packed store and the fused decode step over it.

NumPy only (no torch): :mod:`kvcx.cache.kvcx_cache` wires this into transformers; the fused kernel is
reached through :mod:`kvcx.cache.fused`, decoding through the codecs.

:class:`PackedStore` keeps one kind (keys or values) of one layer's packed chunks concatenated
per (batch row x KV head): codes ``[N, bytes]``, FP16 scales ``[N, nscale]`` (+ zero points),
the block starts of channel-grouped tokens, and each chunk's facts so that a chunk can still be
decoded on its own (the materialising path).

:class:`PackedKV` pairs a layer's key and value stores; its :meth:`PackedKV.attend` runs one step of one
layer: every query (one token per row, or several: a multi-token step) attends to the packed tokens of its
KV head (read once for all the queries that share it), the exact sink tokens and the full-precision
residual, in one softmax, without writing a dequantized key or value anywhere.
How the kernel works: ``kvcx/codecs/cpu/attn*.h``.
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional

import numpy as np

from kvcx.cache import fused
from kvcx.cache.fused import (  # noqa: F401
    CAUSAL,
    EMPTY_F32_3,
    EMPTY_I64,
    EMPTY_U16,
    NO_MASK,
    Mask,
    Workspace,
    fused_unsupported,
    step_mask,
)
from kvcx.codecs.base import Codec, Packed, get_codec
from kvcx.codecs.dtypes import is_int
from kvcx.codecs.intcodec import IntCodec
from kvcx.codecs.runtime import resolve_threads
from kvcx.errors import CodecError


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
        self._codecs: Dict[tuple, Codec] = {}   # the codec of each distinct chunk config (on n_threads)
        self.version = 0   # changed by every append and drop: a kernel bound to the arrays is bound again

    def __len__(self) -> int:
        return len(self._chunks)

    @property
    def sink_tokens(self) -> int:
        return 0 if self.sinks is None else int(self.sinks.shape[1])

    def _fit(self, p: Packed) -> tuple:
        """(N, S, D, sinks) of a chunk this store can take next (an error naming the sizes if it cannot)."""
        S, D = int(p.shape[-2]), int(p.shape[-1])
        N = p.numel // (S * D)
        t0 = int(p.config.get("sinks", 0))
        if N != self.N or D != self.D:
            raise CodecError(f"a packed chunk of shape {list(p.shape)} does not fit this store ({self.N} slabs of "
                             f"head dim {self.D})")
        if t0 and self._chunks:
            raise CodecError("only the first packed chunk may hold exact sink tokens")
        return N, S, D, t0

    def _add(self, p: Packed, chunk: dict, S: int, t0: int, group: Optional[int]) -> None:
        """What every chunk adds once its codes are kept: key blocks of ``group`` tokens (None: keys per token),
        its sinks, its tokens, its facts."""
        if group is not None:
            starts = self.tokens + np.arange(group, S - t0, group, dtype=np.int64)
            self.block_starts = np.concatenate([self.block_starts[:-1], [self.tokens], starts,
                                                [self.tokens + S - t0]]).astype(np.int64)
        if t0:
            self.sinks = np.ascontiguousarray(p.sinks).reshape(self.N, t0, self.D)
            self._sinks_f32 = None
        self.tokens += S - t0
        self._chunks.append(chunk)
        self.version += 1

    def drop_chunks(self, k: int) -> int:
        """Drop the first ``k`` chunks (none of them holding sinks), as a sliding window leaves them behind: the
        arrays keep only the later chunks' columns (one copy of what stays). Returns the tokens dropped."""
        if k <= 0:
            return 0
        if k > len(self._chunks) or any(c["config"].get("sinks", 0) for c in self._chunks[:k]):
            raise CodecError(f"cannot drop {k} of {len(self._chunks)} packed chunks (chunks with exact sink tokens "
                             "stay)")
        gone = sum(int(c["shape"][-2]) for c in self._chunks[:k])
        self._drop_columns(k)
        self._rebase(gone)
        return gone

    def _drop_columns(self, k: int) -> None:
        """Drop the first k chunks' columns (codes, scales, zero points) and their records."""
        ca, sa = (self._chunks[k]["codes"][0], self._chunks[k]["scales"][0]) if k < len(self._chunks) else \
            (self.codes.shape[1], self.scales.shape[1])
        self.codes = np.ascontiguousarray(self.codes[:, ca:])
        self.scales = np.ascontiguousarray(self.scales[:, sa:])
        if self.zeros is not None:
            self.zeros = np.ascontiguousarray(self.zeros[:, sa:])
        self._chunks = [dict(c, codes=(c["codes"][0] - ca, c["codes"][1] - ca),
                             scales=(c["scales"][0] - sa, c["scales"][1] - sa)) for c in self._chunks[k:]]

    def _rebase(self, gone: int) -> None:
        """What every store shifts when ``gone`` leading tokens are dropped: block starts and token count."""
        starts = self.block_starts[self.block_starts >= gone] - gone
        self.block_starts = (starts if starts.size and starts[0] == 0 else np.concatenate([[0], starts])).astype(
            np.int64)
        self.tokens -= gone
        self.version += 1

    def append(self, p: Packed) -> None:
        """Add an encoded chunk (shape [..., S, D] with N slabs; only the first may hold sinks)."""
        cfg = p.config
        N, S, D, t0 = self._fit(p)
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
        if cfg.get("axis") == "token" and ((S - t0) * D) % int(cfg["group_size"]):
            self.whole_groups = False
        self._add(p, chunk, S, t0, int(cfg["group_size"]) if cfg.get("axis") == "channel" else None)

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

    def _codec(self, config: dict, n_threads: Optional[int]) -> Codec:
        k = (tuple(sorted(config.items())), n_threads)
        if k not in self._codecs:
            self._codecs[k] = get_codec(config, n_threads)
        return self._codecs[k]

    def decode_chunk(self, i: int, name: str = "tensor", n_threads: Optional[int] = None) -> np.ndarray:
        """Chunk i decoded on its own (a new array of its shape and dtype)."""
        p = self.chunk(i)
        return self._codec(p.config, n_threads).decode(p, name=name)

    def decode_into(self, out: np.ndarray, name: str = "tensor", n_threads: Optional[int] = None) -> int:
        """Decode every chunk into ``out`` (the chunks' leading dims and D, at least :attr:`held` tokens on axis
        -2) from token 0; returns the tokens written."""
        off = 0
        for p in self.spans():
            self._codec(p.config, n_threads).decode(p, out, name=name, token_offset=off)
            off += p.shape[-2]
        return off

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
        return self._held(self.codes, self.scales, self.zeros)

    def _held(self, *arrays) -> int:
        """Bytes of ``arrays`` and of what every store holds: block starts and sinks (float32 copy included)."""
        arrays += (self.block_starts, self.sinks, self._sinks_f32 if self._sinks_f32 is not self.sinks else None)
        return int(sum(a.nbytes for a in arrays if a is not None))

    @staticmethod
    def kernel_settings(codec: Codec) -> dict:
        """The fused kernel's settings for keys of ``codec`` kept in a store of this kind."""
        return dict(k_axis=fused.AXIS_CHANNEL if codec.axis == "channel" else fused.AXIS_TOKEN, k_asym=codec.asym,
                    k_rotate=codec.rotate, k_group=codec.group_size, k_bits=codec.bits)

    def kernel_keys(self, codec: Codec) -> dict:
        """The arrays the fused kernel reads when this store holds keys of ``codec`` (``AttnKernel.bind``'s key
        arguments)."""
        per_channel = codec.axis == "channel"
        return dict(kc=self.codes, ks=self.scales.view(np.uint16),
                    kz=self.zeros.view(np.uint16) if self.zeros is not None else EMPTY_U16,
                    kblk=self.block_starts if per_channel else EMPTY_I64)


class WidthStore(PackedStore):
    """The packed keys of one layer encoded with a width per channel (:class:`~kvcx.codecs.widths.WidthCodec`),
    laid out for the fused kernel: a slab's planes take as many bytes as its widths say, so they are kept
    in one flat array with each group's offset, beside rectangular tables [N, ...] of the groups' range bytes
    and of each chunk's widths and channel ranges (docs/FORMAT.md 2.4 has the chunk's own layout, which
    :meth:`chunk` rebuilds)."""

    PAD = 8   # bytes kept after the last plane: the kernel reads 8 bytes from any plane byte

    def __init__(self, N: int, D: int):
        super().__init__(N, D)
        self.planes = np.zeros(self.PAD, dtype=np.uint8)
        self.goff = np.empty((self.N, 0), dtype=np.int64)              # [N, groups] planes' offsets
        self.stats = np.empty((self.N, 0), dtype=np.uint8)             # [N, groups * 2 D] range bytes
        self.widths = np.empty((self.N, 0), dtype=np.uint8)            # [N, chunks * D]
        self.ranges = np.empty((self.N, 0), dtype=np.float16)          # [N, chunks * 2 D]
        self.group_chunk = np.empty(0, dtype=np.int64)                 # [groups]

    def append(self, p: Packed) -> None:
        if p.config.get("id") != fused.WIDTHS:
            raise CodecError(f"a {p.config.get('id')!r} chunk does not fit a store of per-channel widths")
        N, S, D, t0 = self._fit(p)
        gs = int(p.config["group_size"])
        G = -(-(S - t0) // gs)
        codes = np.asarray(p.codes).reshape(-1)
        widths = codes[:N * D].reshape(N, D)
        stats = codes[N * D:N * D + N * G * D * 2].reshape(N, G * D * 2)
        planes = codes[N * D + N * G * D * 2:]
        _, slab_off, gbytes = self._codec(p.config, None).plane_offsets(widths, G)
        start = self.planes.size - self.PAD
        goff = start + slab_off[:, None] + np.arange(G, dtype=np.int64)[None, :] * gbytes[:, None]
        chunk = {"shape": tuple(p.shape), "dtype": p.dtype, "config": dict(p.config), "meta": dict(p.meta),
                 "groups": (self.stats.shape[1] // (2 * D), self.stats.shape[1] // (2 * D) + G),
                 "planes": (start, start + planes.size)}
        self.planes = np.concatenate([self.planes[:start], planes, np.zeros(self.PAD, dtype=np.uint8)])
        self.goff = np.concatenate([self.goff, goff], axis=1)
        self.stats = np.concatenate([self.stats, stats], axis=1)
        self.widths = np.concatenate([self.widths, widths], axis=1)
        self.ranges = np.concatenate([self.ranges, np.asarray(p.scales, dtype=np.float16).reshape(N, 2 * D)], axis=1)
        self.group_chunk = np.concatenate([self.group_chunk, np.full(G, len(self._chunks), dtype=np.int64)])
        self._add(p, chunk, S, t0, gs)

    def _drop_columns(self, k: int) -> None:
        """The first k chunks' planes, groups' tables, widths and ranges dropped (:meth:`PackedStore.drop_chunks`)."""
        g = self._chunks[k - 1]["groups"][1]            # the groups of the dropped chunks
        pa = self._chunks[k - 1]["planes"][1]           # and their planes' bytes
        D = self.D
        self.planes = np.ascontiguousarray(self.planes[pa:])
        self.goff = np.ascontiguousarray(self.goff[:, g:] - pa)
        self.stats = np.ascontiguousarray(self.stats[:, g * 2 * D:])
        self.widths = np.ascontiguousarray(self.widths[:, k * D:])
        self.ranges = np.ascontiguousarray(self.ranges[:, k * 2 * D:])
        self.group_chunk = np.ascontiguousarray(self.group_chunk[g:] - k)
        self._chunks = [dict(c, groups=(c["groups"][0] - g, c["groups"][1] - g),
                             planes=(c["planes"][0] - pa, c["planes"][1] - pa)) for c in self._chunks[k:]]

    def chunk(self, i: int) -> Packed:
        c = self._chunks[i]
        D = self.D
        g0, g1 = c["groups"]
        a, b = c["planes"]
        codes = np.concatenate([self.widths[:, i * D:(i + 1) * D].reshape(-1),
                                self.stats[:, g0 * 2 * D:g1 * 2 * D].reshape(-1), self.planes[a:b]])
        return Packed(codes=codes, scales=np.ascontiguousarray(self.ranges[:, i * 2 * D:(i + 1) * 2 * D]).reshape(
                          self.N, D, 2), zeros=None, sinks=self.sinks if c["config"].get("sinks", 0) else None,
                      shape=c["shape"], dtype=c["dtype"], config=c["config"], meta=c["meta"])

    def spans(self):
        """Each chunk on its own (every chunk has its own widths)."""
        for i in range(len(self._chunks)):
            yield self.chunk(i)

    @property
    def nbytes(self) -> int:
        return self._held(self.planes, self.goff, self.stats, self.widths, self.ranges, self.group_chunk)

    @staticmethod
    def kernel_settings(codec: Codec) -> dict:
        return dict(k_axis=fused.AXIS_CHANNEL, k_asym=True, k_rotate=False, k_group=codec.group_size, k_bits=0,
                    k_widths=True)

    def kernel_keys(self, codec: Codec) -> dict:
        return dict(kc=self.planes[None, :], ks=self.stats.view(np.uint16), kz=EMPTY_U16, kblk=self.block_starts,
                    kgoff=self.goff, kw=self.widths, krange=self.ranges.view(np.uint16), kgchunk=self.group_chunk)


# the store that keeps each key codec's chunks (PackedStore for any other)
KEY_STORES = {fused.WIDTHS: WidthStore}


class PackedKV:
    """One layer's packed keys and values, and the fused decode step over them.

    ``key_codec`` / ``value_codec``: the codecs of the first chunk (their sinks say how many leading
    tokens are exact); later chunks are appended without sinks. The leading tokens that either kind
    keeps exact form the *head*: attention reads them as float32 rows (exact where kept exact, decoded
    where packed: the same values the materialising path decodes), and the packed stores from there on.
    """

    def __init__(self, N: int, D: int, key_codec: Codec, value_codec: Codec,
                 workspace: Optional[Workspace] = None, value_dim: Optional[int] = None):
        self.keys = KEY_STORES.get(key_codec.codec_id, PackedStore)(N, D)
        self.values = PackedStore(N, D if value_dim is None else value_dim)
        self.key_codec, self.value_codec = key_codec, value_codec
        self._head = None
        self._why = {}          # (head dim, group) -> why the kernel cannot read the stores (None: it can)
        # the kernel's workspace, kept between steps: this store's own (counted in nbytes) or a shared one
        self._own_workspace = workspace is None
        self.workspace = workspace if workspace is not None else Workspace()
        self._bound, self._bound_key, self._bound_work = None, None, None

    def __len__(self) -> int:
        return len(self.keys)

    @property
    def tokens(self) -> int:
        """Tokens held (sinks included)."""
        return self.keys.tokens + self.keys.sink_tokens

    def append(self, pk: Packed, pv: Packed) -> None:
        if tuple(pk.shape[:-1]) != tuple(pv.shape[:-1]):
            raise CodecError(f"packed keys {list(pk.shape)} and values {list(pv.shape)} differ in shape")
        self.keys.append(pk)
        self.values.append(pv)

    def drop_chunks(self, k: int) -> int:
        """Drop the first ``k`` chunks of keys and values (a sliding window has left them); returns the tokens
        dropped. Chunks with exact sink tokens stay (a windowed layer packs none)."""
        gone = self.keys.drop_chunks(k)
        self.values.drop_chunks(k)
        self._head = None
        return gone

    def chunk_tokens(self, i: int) -> int:
        """Tokens of chunk i (sinks included)."""
        return self.keys.chunk_tokens(i)

    @property
    def version(self) -> int:
        """Changed by every append and drop (a kernel bound to the stores is bound again)."""
        return self.keys.version

    def unsupported(self, head_dim: int, group: int) -> Optional[str]:
        """Why the fused kernel cannot read these stores (None when it can)."""
        if self.keys.D != self.values.D:
            return (f"fused attention reads keys and values of one width; this layer's keys are {self.keys.D} wide "
                    f"and its values {self.values.D} (MLA): its steps decode the packed context")
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
                    full = store.decode_chunk(0, name="head").astype(np.float32, copy=False)
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

    def _kernel(self, B: int, Hkv: int, R: int, D: int, threads: int, nq: int = 1):
        """The fused kernel bound to the stores as they are now (bound again on change: new chunks, another
        geometry, or the shared workspace reallocated by another layer)."""
        key = (B, Hkv, R, D, threads, nq, self.version)
        if self._bound_key == key and self.workspace.array is self._bound_work:
            return self._bound
        nh = max(self.keys.sink_tokens, self.values.sink_tokens)  # the head rows: exact in either kind
        self._bound = fused.bind(self.key_codec, self.value_codec, B, Hkv, R, D, self.keys, self.values, self.head(),
                                 self.tokens - nh, self.workspace, threads, nq)
        self._bound_key, self._bound_work = key, self.workspace.array
        return self._bound

    def attend(self, q: np.ndarray, residual_k: Optional[np.ndarray], residual_v: Optional[np.ndarray],
               mask: Optional[np.ndarray], scaling: float, n_threads: Optional[int] = None,
               out: Optional[np.ndarray] = None, sinks: Optional[np.ndarray] = None, softcap: Optional[float] = None,
               skip: int = 0) -> np.ndarray:
        """One step: every query attends to the held tokens, then the residual.

        q: [B, Hq, D] float32 queries (one token per row) or [B, Hq, Q, D] (Q tokens per row: the last Q
        residual tokens are theirs, causal among them unless the mask says otherwise); residual_k/v:
        [B, Hkv, nr, D] float32, the full-precision tokens after the packed ones (the new tokens last) or None;
        mask: [B, kv_len] (one token) or [B, Q, kv_len], float32 added to the scores (0 = attend, -inf =
        masked) or boolean (True = attend), kv_len = held + residual tokens. Returns out, q's shape, float32
        (``out=`` to reuse an array). ``sinks``: float32 [Hq] each query head's sink logit (GPT-OSS's ``s_aux``: a
        term of the softmax's sum that attends to nothing) or None; ``softcap``: scores s capped to softcap
        tanh(s / softcap) before the mask (Gemma 2) or None; ``skip``: packed tokens (after the exact head rows)
        not read, as a sliding window has left them (kv_len then counts the held tokens after them).
        """
        if not (isinstance(q, np.ndarray) and q.dtype == np.float32 and q.ndim in (3, 4) and q.flags.c_contiguous):
            raise CodecError(f"attention: q must be a C-contiguous float32 [B, Hq, D] or [B, Hq, Q, D] array, got "
                             f"{getattr(q, 'dtype', type(q).__name__)} {list(getattr(q, 'shape', ()))}")
        B, Hq, D = q.shape[0], q.shape[1], q.shape[-1]
        nq = q.shape[2] if q.ndim == 4 else 1
        N = self.keys.N
        if self.keys.D != D or N % B or Hq % (N // B) or nq < 1:
            raise CodecError(f"attention: q {list(q.shape)} does not fit the packed stores ({N} rows x KV heads "
                             f"of head dim {self.keys.D})")
        Hkv = N // B
        R = Hq // Hkv
        why = self.unsupported(D, R)
        if why:
            raise CodecError(why)
        if R * nq > fused.ATTN_MAX_ROWS:
            raise CodecError(f"attention: {nq} query tokens of {R} heads per KV head are {R * nq} rows, more than "
                             f"the kernel's {fused.ATTN_MAX_ROWS}: attend in chunks of at most "
                             f"{fused.ATTN_MAX_ROWS // R} tokens")
        held = self.tokens
        if self.values.tokens + self.values.sink_tokens != held:
            raise CodecError(f"attention: {held} key tokens but {self.values.tokens + self.values.sink_tokens} "
                             "value tokens")
        nh = max(self.keys.sink_tokens, self.values.sink_tokens)
        if not is_int(skip) or not 0 <= skip <= held - nh:
            raise CodecError(f"attention: skip={skip!r} must be a count of the {held - nh} packed tokens")
        held -= skip
        sinks = self._sinks(sinks, Hq)
        if softcap is not None and not (isinstance(softcap, (int, float)) and not isinstance(softcap, bool)
                                        and math.isfinite(softcap) and softcap > 0):
            raise CodecError(f"attention: softcap must be a positive number or None, got {softcap!r}")
        rk, rv, nr = EMPTY_F32_3, EMPTY_F32_3, 0
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
        if nq > 1 and nq > nr:
            raise CodecError(f"attention: {nq} query tokens but {nr} residual tokens: the step's own keys and "
                             "values are the residual's last ones")
        want = [B, kv_len] if q.ndim == 3 else [B, nq, kv_len]
        if mask is None:
            m = CAUSAL if nq > 1 else NO_MASK
        elif (isinstance(mask, np.ndarray) and mask.dtype in (np.float32, np.bool_) and mask.flags.c_contiguous
              and list(mask.shape) == want):
            m = step_mask(mask.reshape(B, nq, kv_len), B, nq)
        else:
            raise CodecError(f"attention: mask must be a C-contiguous float32 or boolean {want} array "
                             f"([B={B}{'' if q.ndim == 3 else f', Q={nq}'}, kv_len={kv_len}]), got "
                             f"{getattr(mask, 'dtype', type(mask).__name__)} {list(getattr(mask, 'shape', ()))}")
        if out is None:
            out = np.empty(q.shape, dtype=np.float32)
        elif not (isinstance(out, np.ndarray) and out.dtype == np.float32 and out.shape == q.shape
                  and out.flags.c_contiguous and out.flags.writeable):
            raise CodecError(f"attention: out must be a writeable C-contiguous float32 array of shape {list(q.shape)}")
        self.step(q.reshape(B, Hq * nq, D), rk, rv, m, scaling, resolve_threads(n_threads), out.reshape(B, Hq * nq, D),
                  nq, sinks, float(softcap or 0.0), int(skip))
        return out

    @staticmethod
    def _sinks(sinks, Hq: int) -> Optional[np.ndarray]:
        """``sinks`` as the kernel reads them (float32 [Hq], finite or -inf), or a CodecError naming the fix."""
        if sinks is None:
            return None
        a = np.ascontiguousarray(sinks, dtype=np.float32) if isinstance(sinks, np.ndarray) else None
        if a is None or a.shape != (Hq,) or np.isnan(a).any() or np.isposinf(a).any():
            raise CodecError(f"attention: sinks must be a float array of one logit per query head ([{Hq}]), no NaN "
                             f"or +inf, got {getattr(sinks, 'dtype', type(sinks).__name__)} "
                             f"{list(getattr(sinks, 'shape', ()))}")
        return a

    def step(self, q: np.ndarray, rk: np.ndarray, rv: np.ndarray, mask: Mask, scaling: float, threads: int,
             out: np.ndarray, nq: int = 1, sinks: Optional[np.ndarray] = None, softcap: float = 0.0,
             skip: int = 0) -> np.ndarray:
        """One step for a caller that built every array itself (:meth:`attend` after its checks,
        :mod:`kvcx.cache.kvcx_cache` per layer step): q and out [B, Hq * nq, D] (query head h's nq tokens at
        rows h * nq ..), rk / rv [N, nr, D] (nr may be 0; the step's own tokens are the last nq), ``mask`` a
        :class:`~kvcx.cache.fused.Mask`, arrays float32 and C-contiguous (the kernel's typed arguments refuse
        anything else); ``sinks`` float32 [Hq // nq] or None, ``softcap`` (0: none) and ``skip`` as :meth:`attend`
        takes them. Only the sizes the kernel indexes by are checked here: a decode step runs once per layer and
        token, and the per-call checks cost as much as the kernel on short contexts."""
        B, Hq, D = q.shape
        nh = max(self.keys.sink_tokens, self.values.sink_tokens)
        N, nr, held = self.keys.N, rk.shape[1], self.tokens - skip
        if (not B or D != self.keys.D or N % B or nq < 1 or Hq % (nq * (N // B)) or (nr and rk.shape != (N, nr, D))
                or rv.shape != rk.shape or out.shape != q.shape or not mask.fits(B, nq, held + nr)
                or held + nr == 0 or (nq > 1 and nq > nr) or Hq // (N // B) > fused.ATTN_MAX_ROWS
                or not 0 <= skip <= self.tokens - nh or (sinks is not None and sinks.shape != (Hq // nq,))):
            raise CodecError(f"attention: q {list(q.shape)} ({nq} per row), residual {list(rk.shape)} / "
                             f"{list(rv.shape)}, mask {list(mask.array.shape)}, "
                             f"out {list(out.shape)} do not fit the packed stores ({N} rows x KV heads of head dim "
                             f"{self.keys.D}, {held} tokens)")
        rows = Hq // (N // B)
        if (held + 4 * nr) * max(1, rows // fused.ATTN_TILE_ROWS) < fused.MIN_PARALLEL_TOKENS:
            threads = 1
        self._kernel(B, N // B, rows // nq, D, threads, nq).run(q, rk, rv, mask.add, mask.keep, mask.bs, mask.qs,
                                                                mask.causal, out, scaling, threads, sinks, softcap,
                                                                held - nh if skip else -1)
        return out
