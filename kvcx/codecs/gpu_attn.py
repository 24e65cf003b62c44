"""The fused decode attention over packed records on torch tensors through Triton kernels
(:mod:`kvcx.codecs.triton_kernels.attention`, the split merge in :mod:`~kvcx.codecs.triton_kernels.merge`): the
launch settings, the spans a step reads, the grid, the launches and the merge, as :mod:`kvcx.codecs.gpu` does for the
codec's kernels. torch and triton are imported when first used."""
from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass, fields
from typing import Optional

from kvcx.codecs import tensors
from kvcx.codecs.backends import is_tensor
from kvcx.codecs.base import Packed
from kvcx.codecs.dtypes import is_int
from kvcx.codecs.splits import split_tiles
from kvcx.codecs.tensors import float_mask, merge_writes, query_rows, triton_kernels
from kvcx.deps import import_torch as _torch
from kvcx.errors import CodecError

# -- fused decode attention over packed records ----------------------------------------------------------
TILE_TOKENS = 64   # the longest tile a program reads: paged stores' pages and static rows are whole tiles of it
# each mode's warps a program: the fast mode one (an H100's --tune: 38.1 us at 32k against 40.4 at two), the exact
# mode two (at one its registers spill; an H200's choice), TF32 passes two (an H100's), FP32 sums four
MODE_WARPS = {"fp16": 1, "int8x3": 2, "tf32x2": 2, "tf32": 2, "tf32x3": 2, "ieee": 2, "": 4}
DOTS = tuple(MODE_WARPS)   # the products a launch may take (LaunchSettings.dot)
_WARPS = (1, 2, 4, 8, 16)


@dataclass(frozen=True)
class LaunchSettings:
    """How the fused decode attention launches its two kernels (the attention's splits and their merge): passed to
    :func:`attend`, :func:`attend_spans`, :func:`kvcx.codecs.paged.attend`, and to ``KvcxCache`` /
    ``StaticKvcxCache`` as ``launch=``; :data:`DEFAULT_LAUNCH` when not given. Frozen and checked when made (a
    :class:`~kvcx.errors.CodecError` naming the field). The defaults are the fast mode ("fp16"), one warp a program,
    two stages, 8 programs a multiprocessor: by the offline count (docs/results/gpu-sass.md) and an H100's ``--tune``
    (docs/RESULTS.md). ``str()`` names the fields that differ from the defaults (what a tune prints a row as).

    - ``dot``: the products. "fp16" (the default: the codes as FP16 on the FP16 tensor cores, FP32 sums, the other
      operand rounded to FP16 after a power of two of its own, as FlashAttention rounds P for P V; keys per token
      take "tf32x2"); "" FP32 broadcast sums (CUDA cores); or tl.dot at this input precision: "tf32x2" (the operand
      that is not codes split in two TF32 parts: FP32's accuracy), "tf32", "tf32x3", "ieee", or "int8x3" (the exact
      mode: the codes as int8 on the integer tensor cores, the other operand a 21-bit fixed point of its row in
      three int8 pieces: 2**-20 of the row's largest term at most; "tf32x2" unless the head dim is 64 to 128 and a
      tile 32 to 128 tokens). Query rows are padded to 16.
    - ``block_tokens``: packed tokens a program reads per step (16, 32 or 64: within :data:`TILE_TOKENS`).
    - ``warps``: warps a program, or None: the mode's own (:data:`MODE_WARPS`).
    - ``asm``: "fp16"'s codes become FP16 in PTX on a GPU (inline assembly: a byte permute, lop3 and FP16x2
      arithmetic, 8 codes in 10 instructions); False: the same bits in Triton's own operations (what the
      interpreter always runs).
    - ``prefetch``: the next tile's codes (the fast mode: its scales) loaded before this one is worked.
    - ``stages``: Triton's software pipelining depth for the attention kernel (None: Triton's default).
    - ``split_tokens``: packed tokens a split at least (flash-decoding along the context: short contexts get many
      short splits, each program's tiles one after another being the step's latency).
    - ``programs_per_sm``: splits enough for about this many programs a multiprocessor.
    - ``program_tiles``: a program's fixed time in tiles beside its tiles (its query, first loads, outputs), for
      :func:`kvcx.codecs.splits.split_tiles`: fitted to an H100's batch-8 steps (docs/RESULTS.md).
    - ``max_registers``: ptxas's cap on the attention kernel's registers a thread (Triton's ``maxnreg``, 24 to
      255), or None: ptxas's own (at 255 eight one-warp programs fit a multiprocessor, at 128 sixteen).
    - ``merge_splits``: splits the merge kernel reads at a time (a power of two from 2; a program a query row).
    - ``merge_warps``: warps a merge program (a batch-1 step's merge is 32 programs: its latency counts).
    - ``merge_pdl``: the merge launched while the attention runs (sm_90: a dependent launch that waits for the
      attention's grid to read the splits; an H100's ``--tune`` chose it, 4k -16 %).
    - ``early_tile``: the fast mode's first tile loaded before the query (no gain measured: docs/RESULTS.md).
    - ``fp_fusion``: a * b + c as one FMA in the attention kernels (one rounding instead of two: no less accurate).
      The codec kernels keep it off: they round as the CPU kernels do, bit for bit.
    """

    dot: str = "fp16"
    block_tokens: int = 64
    warps: Optional[int] = None
    asm: bool = True
    prefetch: bool = False
    stages: Optional[int] = 2
    split_tokens: int = 64
    programs_per_sm: int = 8
    program_tiles: float = 0.5
    max_registers: Optional[int] = None
    merge_splits: int = 64
    merge_warps: int = 4
    merge_pdl: bool = True
    early_tile: bool = False
    fp_fusion: bool = True

    def __post_init__(self):
        def bad(name, wants):
            raise CodecError(f"LaunchSettings({name}={getattr(self, name)!r}): {wants}")

        def whole(v, lo, hi=None):
            return is_int(v) and not isinstance(v, bool) and v >= lo and (hi is None or v <= hi)

        if self.dot not in DOTS:
            bad("dot", f"not a mode of the attention kernel; use one of {', '.join(repr(d) for d in DOTS)}")
        if self.block_tokens not in (16, 32, 64):
            bad("block_tokens", f"a tile is 16, 32 or 64 tokens (within the stores' {TILE_TOKENS}-token tiles)")
        if self.warps is not None and self.warps not in _WARPS:
            bad("warps", "a program's warps are 1, 2, 4, 8 or 16, or None (each mode's own: MODE_WARPS)")
        if self.merge_warps not in _WARPS:
            bad("merge_warps", "a merge program's warps are 1, 2, 4, 8 or 16")
        if self.stages is not None and not whole(self.stages, 1, 8):
            bad("stages", "pipelining stages are an integer from 1 to 8, or None (Triton's default)")
        if self.max_registers is not None and not whole(self.max_registers, 24, 255):
            bad("max_registers", "ptxas takes a register cap from 24 to 255; or None (ptxas's own)")
        if not (whole(self.merge_splits, 2) and self.merge_splits & (self.merge_splits - 1) == 0):
            bad("merge_splits", "splits the merge reads at a time are a power of two from 2 (16, 64, 256, ...)")
        for name in ("split_tokens", "programs_per_sm"):
            if not whole(getattr(self, name), 1):
                bad(name, "a positive integer")
        if isinstance(self.program_tiles, bool) or not isinstance(self.program_tiles, (int, float)) or \
                not 0 <= self.program_tiles < 1e6:
            bad("program_tiles", "a number of tiles from 0")
        for name in ("asm", "prefetch", "merge_pdl", "early_tile", "fp_fusion"):
            if not isinstance(getattr(self, name), bool):
                bad(name, "True or False")

    def replace(self, **changes) -> "LaunchSettings":
        """These settings with ``changes`` (field names), checked as when made."""
        unknown = sorted(set(changes) - {f.name for f in fields(self)})
        if unknown:
            raise CodecError(f"LaunchSettings has no field {', '.join(unknown)}; its fields: "
                             f"{', '.join(f.name for f in fields(self))}")
        return dataclasses.replace(self, **changes)

    def program_warps(self, dot: str) -> int:
        """Warps an attention program runs with for the products ``dot`` a launch takes."""
        return self.warps or MODE_WARPS[dot]

    def __str__(self) -> str:
        changed = [f"{f.name}={getattr(self, f.name)!r}" for f in fields(self)
                   if getattr(self, f.name) != f.default]
        return f"LaunchSettings({', '.join(changed)})" if changed else "LaunchSettings() (the defaults)"


DEFAULT_LAUNCH = LaunchSettings()   # what a launch takes when none is given


def launch_settings(launch) -> LaunchSettings:
    """``launch`` as the settings a launch takes: :data:`DEFAULT_LAUNCH` for None; a CodecError for anything
    that is not a :class:`LaunchSettings`."""
    if launch is None:
        return DEFAULT_LAUNCH
    if not isinstance(launch, LaunchSettings):
        raise CodecError(f"launch must be a kvcx.codecs.gpu_attn.LaunchSettings or None, got "
                         f"{type(launch).__name__}: build one, e.g. LaunchSettings(dot='int8x3')")
    return launch


def attention_kernels():
    """The fused attention's Triton kernels (:mod:`kvcx.codecs.triton_kernels.attention`)."""
    return triton_kernels("attention")

@functools.lru_cache(maxsize=None)
def _hadamard(D: int, device):
    """The orthonormal Walsh-Hadamard matrix of size D (symmetric: its own inverse), built once per device."""
    torch = _torch()
    h = torch.ones(1, 1, dtype=torch.float32)
    while h.shape[0] < D:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h * tensors.norm_of(D)).to(device)


def rotated_query(q, scaling: float):
    """The query rows ``q`` [N, R, D] in FP32 times ``scaling``, rotated as keys that rotate are: what the attention
    kernel reads for them (the keys' rotation moved from every key onto the query; its matrix is orthogonal and
    symmetric)."""
    return (q.float() * scaling) @ _hadamard(q.shape[-1], q.device)


@dataclass(frozen=True)
class PackedSpan:
    """Packed tokens of one kind that continue one another, laid out per slab (batch row x KV head) as the
    attention kernel reads them: ``codes`` uint8 [N, row bytes], ``scales`` FP16 [N, groups] (per-token groups)
    or [N, blocks, D] (per-channel groups), ``zeros`` like ``scales`` or None, ``tokens`` packed tokens from
    the first; rows may be longer than the tokens need (a growing store's capacity)."""

    codes: object
    scales: object
    zeros: object
    tokens: int


def span_of(rec: Packed, codec) -> PackedSpan:
    """The span of a Triton-backend record of [B, Hkv, S, D] (its packed tokens: S minus the sinks)."""
    lay = codec.layout(tuple(rec.shape), "span")
    return PackedSpan(rec.codes.view(lay.N, -1), rec.scales.view(lay.scale_shape),
                      None if rec.zeros is None else rec.zeros.view(lay.scale_shape), lay.S - lay.t0)


def split_tokens(slabs: int, tokens, per_split: Optional[int] = None, launch: Optional[LaunchSettings] = None) -> int:
    """Packed tokens per split (whole tiles of ``launch.block_tokens``): ``per_split`` if given, else
    :func:`~kvcx.codecs.splits.split_tiles`' choice for ``tokens``, the packed tokens of each span a slab reads (an
    int: one span), at least ``launch.split_tokens`` (:class:`LaunchSettings`; None: :data:`DEFAULT_LAUNCH`)."""
    launch = launch_settings(launch)
    bt = launch.block_tokens
    if per_split is None:
        spans = (tokens,) if is_int(tokens) else tuple(tokens)
        tiles = tuple(-(-int(n) // bt) for n in spans if n > 0) or (1,)
        slots = launch.programs_per_sm * tensors.multiprocessors()
        per_split = max(launch.split_tokens, split_tiles(slabs, tiles, slots, launch.program_tiles) * bt)
    per = max(bt, int(per_split))
    return -(-per // bt) * bt


@dataclass(frozen=True)
class Span:
    """Packed keys and values of the same tokens for :func:`attend_spans`: their spans and codecs, and the mask
    column of their first token."""

    keys: PackedSpan
    values: PackedSpan
    key_codec: object
    value_codec: object
    mask_off: int


def interpreting() -> bool:
    """Whether Triton's interpreter runs the kernels (``TRITON_INTERPRET=1``): no inline assembly there."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def attention_rows(R: int, NG: int, dot: str) -> int:
    """The query rows RP the attention kernel pads R to, for NG value groups a token: its products have RP x NG
    rows (each query row once per group), and tl.dot needs at least 16, so with ``dot`` the groups fill rows that
    would otherwise be padding."""
    return max(tensors.pow2(R), -(-16 // NG)) if dot else tensors.pow2(R)


def attention_constexprs(key_codec, value_codec, R: int, D: int, has_mask: bool,
                         launch: Optional[LaunchSettings] = None, asm: bool = False, pdl: bool = False, page: int = 0,
                         softcap: float = 0.0):
    """The constexprs of :func:`~kvcx.codecs.triton_kernels.attention.attend_packed_kernel` for these codecs and
    ``launch`` (:class:`LaunchSettings`; None: :data:`DEFAULT_LAUNCH`): what the launcher passes; the offline compile
    test and bench/sass_gpu.py build the kernel the same way. A tile lies within one per-channel block and one
    ``page`` (a paged store's page tokens, or 0): ``launch.block_tokens`` is cut to the smallest of them; its
    ``dot`` to what the shapes allow (FP32 sums under head dim 32, two TF32 passes where int8 products would not
    do and for "fp16" with per-token keys, whose scales vary along the products' sums). ``asm``: "fp16"'s codes
    converted in PTX (a GPU: :func:`ptx_codes`); ``launch.prefetch``: the next tile's codes loaded before a tile is
    worked (not paged), in the transposed fast mode its scales (``AHEAD``); ``launch.early_tile``: that mode's first
    tile loaded before the query; ``pdl``: the merge launched as a dependent launch (a GPU:
    :func:`dependent_merge`); ``softcap``: Gemma 2's."""
    launch = launch_settings(launch)
    dot, prefetch, early, paged = launch.dot, launch.prefetch, launch.early_tile, page > 0
    ng = 1 if value_codec.axis == "channel" else max(1, D // value_codec.group_size)
    bt = min([launch.block_tokens] + ([page] if paged else []) +
             [c.group_size for c in (key_codec, value_codec) if c.axis == "channel"])
    if D < 32:
        dot = ""          # tl.dot needs 16 along each side: D // 2 channels a stream
    elif dot == "int8x3" and not (64 <= D <= 128 and 32 <= bt <= 128):
        dot = "tf32x2"    # int8 products sum 32 or more (channels a stream, a tile's tokens); exact in int32 to 128
    elif dot == "fp16" and (key_codec.axis != "channel" or bt < 16):
        dot = "tf32x2"    # per-token keys: a scale a group of a token's channels (dequantized in the tile)
    # the fast mode with per-channel keys and per-token values runs transposed (the tokens the products' long side)
    trans = dot == "fp16" and key_codec.axis == "channel" and value_codec.axis != "channel"
    rp = max(tensors.pow2(R), -(-8 // ng)) if trans else attention_rows(R, ng, dot)
    return dict(R=R, RP=rp, D=D, BT=bt, KG=key_codec.group_size,
                K_CHANNEL=key_codec.axis == "channel", K_ASYM=key_codec.asym, VG=value_codec.group_size,
                V_CHANNEL=value_codec.axis == "channel", V_ASYM=value_codec.asym, HAS_MASK=has_mask, DOT=dot, NG=ng,
                PREFETCH=bool(prefetch) and not trans and not paged, ASM=bool(asm) and dot == "fp16", PAGE=0,
                TRANS=trans, EARLY=bool(early) and trans, PDL=bool(pdl), AHEAD=bool(prefetch) and trans,
                SOFTCAP=float(softcap or 0.0))


def attention_options(const: dict, launch: Optional[LaunchSettings] = None) -> dict:
    """The attention kernel's launch options for its constexprs ``const`` (:func:`attention_constexprs`) under
    ``launch`` (None: :data:`DEFAULT_LAUNCH`): warps (its own, or the mode's: :data:`MODE_WARPS`), pipelining
    stages, register cap, FMA fusion."""
    launch = launch_settings(launch)
    extra = dict(num_warps=launch.program_warps(const["DOT"]), enable_fp_fusion=launch.fp_fusion)
    if launch.stages is not None:
        extra["num_stages"] = launch.stages
    if launch.max_registers is not None:
        extra["maxnreg"] = launch.max_registers
    return extra


def _span_args(sp: Span) -> tuple:
    """A span's arguments of the attention kernel: (its six buffers, its integers in the kernel's order: tokens,
    key and value row bytes, key and value scale columns, the mask column of its first token)."""
    ks, vs = sp.keys, sp.values
    buffers = (ks.codes, ks.scales, ks.zeros if ks.zeros is not None else ks.scales,
               vs.codes, vs.scales, vs.zeros if vs.zeros is not None else vs.scales)
    return buffers, (ks.tokens, ks.codes.shape[1], vs.codes.shape[1], ks.scales.shape[1], vs.scales.shape[1],
                     sp.mask_off)


def attend_spans(q, scaling: float, spans, Hkv: int, sinks=(None, None), residual=(None, None), add=None,
                 res_off: int = 0, per_split: Optional[int] = None, out=None, sink_logits=None, softcap: float = 0.0,
                 launch: Optional[LaunchSettings] = None):
    """The attention output [N, R, D] float32 of the query rows ``q`` [N, R, D] (:func:`query_rows`: any float
    dtype, as the model holds them; the kernels scale them by ``scaling`` as they read them) over packed spans
    (:class:`Span`, flash-decoding splits along each in :func:`~kvcx.codecs.triton_kernels.attention.attend_packed_kernel`) and
    the exact tokens: ``sinks`` (keys, values) [N, t0, D] at mask columns 0.., ``residual`` [N, nr, D] (any
    float dtype, as held) at columns ``res_off``..; ``add`` float32 [B, kv_len] added to the scores, or None.
    Every span's values rotate alike (the merge rotates the accumulator back once). One kernel per two spans of
    one layout (a store's two segments: one launch) and one merge: no other launch (but for spans whose keys
    rotate: their query, scaled and rotated, from one product; the keys' rotation moved from every key onto the
    query, its matrix orthogonal and symmetric). The caller checks shapes; ``out``, ``sink_logits``, ``softcap``:
    as :func:`merge_splits`' (the softcap in both kernels); ``launch``: :class:`LaunchSettings` (None: the defaults)."""
    torch, launch = _torch(), launch_settings(launch)
    N, R, D = q.shape
    rotate = {sp.value_codec.rotate for sp in spans}
    if len(rotate) > 1:
        raise CodecError("attention: the packed spans' values must all rotate, or none")
    full = [sp for sp in spans if sp.keys.tokens]
    asm, pdl = ptx_codes(q, launch), dependent_merge(q, launch)
    qr = rotated_query(q, scaling) if any(sp.key_codec.rotate for sp in full) else None
    per = split_tokens(N, [sp.keys.tokens for sp in full], per_split, launch) if full else 0   # one size for all
    launches = []   # [((constexprs, keys rotate), [(span, splits)])]: two spans of one layout share a launch
    for sp in full:
        key = (attention_constexprs(sp.key_codec, sp.value_codec, R, D, add is not None, launch, asm, pdl,
                                    softcap=softcap), sp.key_codec.rotate)
        item = (sp, -(-sp.keys.tokens // per))
        if launches and launches[-1][0] == key and len(launches[-1][1]) == 1:
            launches[-1][1].append(item)
        else:
            launches.append((key, [item]))
    spt = max(1, sum(n for _, items in launches for _, n in items))
    if full:   # every split written by the kernel
        m, l, acc = (torch.empty(N, spt, R, *d, device=q.device) for d in ((), (), (D,)))
    else:      # no packed token yet: one empty split (weight exp(-inf) = 0 times a sum and an accumulator of 0,
        # not of whatever the allocator held: 0 x NaN would be NaN)
        m = torch.full((N, 1, R), float("-inf"), device=q.device)
        l, acc = torch.zeros(N, 1, R, device=q.device), torch.zeros(N, 1, R, D, device=q.device)
    off = 0
    for (const, rotated), items in launches:
        if len(items) == 1:   # a launch of one span passes it as the second too, with no split reading it
            items = items + [(items[0][0], 0)]
        (a, na), (b, nb) = items
        (pa, ia), (pb, ib) = _span_args(a), _span_args(b)
        # a tile lies within one per-channel block (splits are whole tiles of launch.block_tokens, a multiple of it)
        launch_attention((N, na + nb), qr if rotated else q, 1.0 if rotated else scaling, pa + pb,
                         tuple(v for pair in zip(ia, ib) for v in pair), (m, l, acc), Hkv, per, na, off, const, add,
                         launch=launch)
        off += na + nb
    sk, sv = sinks
    rk, rv = residual
    t0 = 0 if sk is None else sk.shape[1]
    nr = 0 if rk is None else rk.shape[1]
    if not full and not t0 and not nr:
        raise CodecError("attention: there are no tokens to attend to")
    return merge_splits(q, scaling, m, l, acc, Hkv, bool(full) and True in rotate, sinks, residual, add, res_off,
                        out=out, sink_logits=sink_logits, softcap=softcap, launch=launch)


def ptx_codes(q, launch: Optional[LaunchSettings] = None) -> bool:
    """Whether the fast mode's codes are converted in PTX on ``q``'s device (``launch.asm``, a GPU, no interpreter)."""
    return launch_settings(launch).asm and q.is_cuda and not interpreting()


def dependent_merge(q, launch: Optional[LaunchSettings] = None) -> bool:
    """Whether a step on ``q``'s device launches the merge as a dependent launch (``launch.merge_pdl``,
    :func:`_takes_pdl`)."""
    return launch_settings(launch).merge_pdl and q.is_cuda and not interpreting() and _takes_pdl(q.device.index)


@functools.lru_cache(maxsize=None)
def _takes_pdl(index: int) -> bool:
    """Whether GPU ``index`` runs the grid-dependency instructions (sm_90 PTX: compute capability 9 or more) and this
    Triton has them (3.4 on); read once a device."""
    return attention_kernels().gdc_launch_dependents is not None and _torch().cuda.get_device_capability(index)[0] >= 9


def launch_attention(grid, q, q_scale: float, buffers: tuple, ints: tuple, out: tuple, Hkv: int, per: int,
                     n_first: int, sp_off: int, const: dict, add=None, pages=None,
                     launch: Optional[LaunchSettings] = None) -> None:
    """One launch of :func:`~kvcx.codecs.triton_kernels.attention.attend_packed_kernel` on ``grid`` (slabs,
    splits): query rows ``q`` times ``q_scale``; ``buffers`` the two spans' six buffers each (codes, scales, zero
    points of keys, then of values), ``ints`` their integers in pairs (:func:`_span_args`' order, the first span's
    then the second's of each); ``out`` the splits' (max, sum, accumulators) of all launches, this one's from split
    ``sp_off``; ``per`` tokens a split, the first span's ``n_first`` splits; ``add`` the scores' float mask or None;
    ``pages`` (block table, lengths) for a paged store's ``const`` (its ``PAGE`` mode) or None; ``launch`` the
    settings ``const`` was made with (its warps, stages, register cap). What
    :func:`attend_spans` and :func:`kvcx.codecs.paged.attend` launch."""
    m, l, acc = out
    table, lens = pages if pages is not None else (m, m)
    attention_kernels().attend_packed_kernel[grid](
        q, *buffers, q_scale, add if add is not None else m, m, l, acc, Hkv, add.stride(0) if add is not None else 0,
        *ints, per, n_first, sp_off, m.shape[1], table, lens, table.stride(0) if pages is not None else 0, **const,
        **attention_options(const, launch))


def merge_splits(q, scaling: float, m, l, acc, Hkv: int, rotate: bool, sinks=(None, None), residual=(None, None),
                 add=None, res_off: int = 0, res_lens=None, out=None, sink_logits=None, softcap: float = 0.0,
                 launch: Optional[LaunchSettings] = None):
    """The attention output [N, R, D] float32 of the query rows ``q`` [N, R, D]: the merge kernel's softmax over the
    splits the attention kernel wrote (``m``, ``l`` [N, splits, R], ``acc`` [N, splits, R, D]; their accumulators
    rotated back where ``rotate``) and the exact tokens (:func:`attend_spans`' ``sinks``, ``residual``, ``add``,
    ``res_off``; ``res_lens`` int32 [B], or None: batch row b's residual is its first ``res_lens[b]`` rows, read on
    the device). One launch: what :func:`attend_spans` and :func:`kvcx.codecs.paged.attend` end with. ``out``: the
    caller's [N, R, D] (contiguous; float32, float16 or bfloat16: rounded to nearest even as ``.to`` rounds).
    ``sink_logits``: float32 [Hkv R] a sink logit a query head (s_aux) or None; ``softcap``: as the splits';
    ``launch``: :class:`LaunchSettings` (None: the defaults; its merge's splits at a time, warps, dependent launch)."""
    torch, k, launch = _torch(), attention_kernels(), launch_settings(launch)
    N, R, D = q.shape
    (sk, sv), (rk, rv) = sinks, residual
    t0 = 0 if sk is None else sk.shape[1]
    nr = 0 if rk is None else rk.shape[1]
    if out is None:
        out = torch.empty(N, R, D, device=q.device)
    elif not (is_tensor(out) and merge_writes(out.dtype) and out.is_contiguous() and out.numel() == N * R * D and
              out.device == q.device):
        raise CodecError(f"attention: out must be a contiguous float32, float16 or bfloat16 tensor of {N * R * D} "
                         f"values ([B, Hq, D]) on {q.device}")
    bf16, pdl = out.dtype == torch.bfloat16, dependent_merge(q, launch)
    k.merge_kernel[(N, R)](q, scaling, m, l, acc, m.shape[1], sk if t0 else m, sv if t0 else m, t0, rk if nr else m,
                           rv if nr else m, nr, add if add is not None else m, add.shape[1] if add is not None else 0,
                           res_off, Hkv, out.view(torch.int16) if bf16 else out, tensors.norm_of(D),
                           res_lens if res_lens is not None else m, m if sink_logits is None else sink_logits,
                           R=R, D=D, OUT_BF16=bf16,
                           HAS_SINKS=sink_logits is not None, SOFTCAP=float(softcap or 0.0),
                           SB=tensors.pow2(t0), RB=max(16, tensors.pow2(nr)), HAS_MASK=add is not None, ROTATE=rotate,
                           CH=launch.merge_splits, enable_fp_fusion=launch.fp_fusion, num_warps=launch.merge_warps, PDL=pdl,
                           RES_LENS=res_lens is not None and nr > 0, **({"launch_pdl": True} if pdl else {}))
    return out


def reads(codec) -> bool:
    """Whether the fused attention reads ``codec``'s records on the device: 4-bit ``kvcx.int`` codes (sinks,
    rotation, either grouping). Other codecs may run on the device (E8P: :mod:`kvcx.codecs.gpu_lattice`) but a cache
    of them attends over what it decodes."""
    return getattr(codec, "codec_id", None) == "kvcx.int" and codec.bits == 4


def attend(q, keys: Packed, values: Packed, key_codec, value_codec, residual_k=None, residual_v=None, mask=None,
           scaling: Optional[float] = None, per_split: Optional[int] = None, launch: Optional[LaunchSettings] = None):
    """One decode step of one layer over packed keys and values on the device, without decoding them: q [B, Hq, D]
    (one token a row); keys / values the Triton backend's records of [B, Hkv, S, D] (4-bit ``IntCodec``, sinks,
    rotation, either grouping); residual_k / _v [B, Hkv, nr, D] full-precision tokens after them, or None; mask
    [B, S + nr] float added to the scores (boolean: True attends), or None; scaling: default 1 / sqrt(D). Query head
    j reads KV head j // (Hq / Hkv) (transformers' repeat_kv). The packed tokens in the Triton kernel, split along
    the context (``per_split`` tokens each); the exact tokens and the merge in a second, FP32; ``launch``: how
    (:class:`LaunchSettings`; None: :data:`DEFAULT_LAUNCH`). [B, Hq, D] float32."""
    B, Hq, D = q.shape
    shape = tuple(keys.shape)
    for codec, rec, what in ((key_codec, keys, "keys"), (value_codec, values, "values")):
        if not reads(codec) or not is_tensor(rec.codes):
            raise CodecError(f"attention: the {what} must be a 4-bit kvcx.int record on the device (the Triton "
                             f"backend's), got {getattr(codec, 'codec_id', codec)!r}")
        if tuple(rec.shape) != shape or len(shape) != 4 or shape[0] != B or shape[3] != D or Hq % shape[1]:
            raise CodecError(f"attention: q {list(q.shape)} does not fit {what} of shape {list(rec.shape)}")
    Hkv, S = shape[1], shape[2]
    N = B * Hkv
    kl, vl = key_codec.layout(shape, "keys"), value_codec.layout(shape, "values")
    if kl.t0 != vl.t0:
        raise CodecError(f"attention: keys keep {kl.t0} exact tokens, values {vl.t0}; they must keep the same")
    t0 = kl.t0
    nr = 0 if residual_k is None else residual_k.shape[2]
    rows = query_rows(q, N)
    add = None if mask is None else float_mask(mask, B, S + nr)
    spans = [Span(span_of(keys, key_codec), span_of(values, value_codec), key_codec, value_codec, t0)] if S > t0 else []
    sinks = (keys.sinks.reshape(N, t0, D).contiguous(), values.sinks.reshape(N, t0, D).contiguous()) if t0 else \
        (None, None)
    residual = (residual_k.reshape(N, nr, D).contiguous(), residual_v.reshape(N, nr, D).contiguous()) if nr else \
        (None, None)
    return attend_spans(rows, D ** -0.5 if scaling is None else float(scaling), spans, Hkv, sinks, residual, add, S,
                        per_split, launch=launch).reshape(B, Hq, D)
