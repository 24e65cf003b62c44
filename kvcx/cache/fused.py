"""The fused attention kernel's own wrapper (kvcx/codecs/cpu/attn.h): what it reads, how work is split, its
workspace, what it masks, and one binding of a layer's packed stores to it.

The kernel comes through the codecs' door (:mod:`kvcx.codecs.attention`): it reads the integer codec's packed
stores directly. Its callers (:class:`kvcx.cache.store.PackedKV`) check every size first.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from kvcx.codecs import attention as kernel

# the codecs whose packed layouts the kernel reads (kvcx/codecs/cpu/attn.h): integer codes for keys and values,
# keys with a width per channel, values in E8P lattice records
READS = "kvcx.int"
WIDTHS = "kvcx.widths"
E8P = "kvcx.e8p"
READS_KEYS = (READS, WIDTHS)

# code widths the kernel reads (2 and 3 bits widened tile by tile into the 4-bit layout)
FUSED_BITS = (2, 3, 4)
ATTN_MAX_GROUP = kernel.ATTN_MAX_GROUP
ATTN_MAX_D = kernel.ATTN_MAX_D
# rows per KV head a step may have: query heads per KV head x query tokens
ATTN_MAX_ROWS = kernel.ATTN_MAX_ROWS
ATTN_TILE_ROWS = kernel.ATTN_TILE_ROWS
# how keys are grouped, as the kernel's settings name it
AXIS_CHANNEL, AXIS_TOKEN = kernel.AXIS_CHANNEL, kernel.AXIS_TOKEN
# tokens per task at least, when a (row x KV head) is split across threads
_MIN_SPLIT_TOKENS = 128
# below this many tokens of work per (row x KV head) (an exact token counting as 4 packed ones), one
# thread: waking a second one costs more than it saves, and its spinning competes with torch's threads
MIN_PARALLEL_TOKENS = 2048

EMPTY_U16 = np.empty((0, 0), dtype=np.uint16)
EMPTY_F32_2 = np.empty((0, 0), dtype=np.float32)
EMPTY_F32_3 = np.empty((0, 0, 0), dtype=np.float32)
EMPTY_I64 = np.empty(0, dtype=np.int64)
EMPTY_U8_2 = np.empty((0, 0), dtype=np.uint8)


@dataclass(frozen=True, eq=False)
class Mask:
    """What a step masks: ``add`` float32 [rows, kv_len] added to the scores, or ``keep`` uint8 [rows, kv_len]
    (0: masked; a boolean mask viewed as bytes), or neither; the row of batch row b and query token i is
    ``b * bs + i * qs`` (0 strides broadcast one row); ``causal``: token i of a step of nq tokens also sees
    nothing past position kv_len - nq + i."""

    add: np.ndarray = field(default_factory=lambda: EMPTY_F32_2)
    keep: np.ndarray = field(default_factory=lambda: EMPTY_U8_2)
    bs: int = 0
    qs: int = 0
    causal: bool = False

    @property
    def array(self) -> np.ndarray:
        """The array the mask holds: ``add`` or ``keep`` (an empty one when nothing is masked)."""
        return self.add if self.add.shape[0] else self.keep

    def fits(self, B: int, nq: int, kv_len: int) -> bool:
        """Whether the arrays hold every row the kernel reads for B batch rows of nq tokens over kv_len."""
        a = self.array
        if not a.shape[0]:
            return True
        last = (B - 1) * self.bs + (nq - 1) * self.qs
        return a.shape[1] == kv_len and 0 <= last < a.shape[0] and self.bs >= 0 and self.qs >= 0


NO_MASK = Mask()   # nothing masked (a single-token step)
CAUSAL = Mask(causal=True)   # a multi-token step with no mask: causal among its tokens


def _causal_only(m: np.ndarray, nq: int) -> bool:
    """Whether a [b, q, kv_len] mask (q 1 or nq) shows each query token every position up to its own and hides
    the rest: nothing the kernel's causal flag does not do alone (transformers builds such a mask for a step of
    several tokens after a prefix with no padding; one check per step spares every layer reading it)."""
    b, q, kv = m.shape
    vis = m if m.dtype == np.bool_ else m == 0
    if m.dtype != np.bool_ and not (vis | np.isneginf(m)).all():
        return False
    if q == 1:
        return bool(vis.all())
    p = kv - nq + 1
    return p > 0 and bool(vis[:, :, :p].all()) and bool((vis[:, :, p:] == np.tri(nq, nq - 1, -1, dtype=bool)).all())


def step_mask(m: np.ndarray, B: int, nq: int) -> Mask:
    """The Mask of a [b, q, kv_len] array (b 1 or B, q 1 or nq; boolean: True attends, or float32 added to the
    scores), viewed without a copy where it is C-contiguous. A mask with one query row in a step of several
    tokens is a padding mask: the step is also causal. A mask that hides nothing but what causality hides is
    :data:`CAUSAL` (or :data:`NO_MASK` for one token)."""
    b, q = m.shape[0], m.shape[1]
    if _causal_only(m, nq):
        return CAUSAL if nq > 1 else NO_MASK
    bs, qs = (q if b == B else 0), (1 if q == nq else 0)
    rows = np.ascontiguousarray(m).reshape(b * q, m.shape[2])
    causal = nq > 1 and q == 1
    if rows.dtype == np.bool_:
        return Mask(keep=rows.view(np.uint8), bs=bs, qs=qs, causal=causal)
    return Mask(add=rows.astype(np.float32, copy=False), bs=bs, qs=qs, causal=causal)


def _int_values_unsupported(value, head_dim: int) -> Optional[str]:
    if value.bits not in FUSED_BITS:
        return f"fused attention reads 2-, 3- and 4-bit codes (values {value.bits} bits)"
    if value.axis != "token":
        return "fused attention needs values grouped per token"
    G = value.group_size
    if G % head_dim and (G > head_dim or head_dim % G or G % 16):
        return (f"fused attention needs per-token value groups of whole tokens or of a whole part of one (group "
                f"size {G} and head dim {head_dim}: a multiple of {head_dim}, or a divisor of it that is a multiple "
                "of 16)")
    return None


def _e8p_values_unsupported(value, head_dim: int) -> Optional[str]:
    if head_dim & (head_dim - 1):
        return f"fused attention reads E8P values of a power-of-two head dim, got {head_dim}"
    return None


def _int_values(value) -> dict:
    return dict(v_asym=value.asym, v_rotate=value.rotate, v_group=value.group_size, v_bits=value.bits)


def _e8p_values(value) -> dict:
    # one record a token (its scale inside), rotated, symmetric; v_group is the head dim (set at bind), bits unused
    return dict(v_asym=False, v_rotate=True, v_e8p=True)


# the value codecs the kernel reads: why it cannot read one (None: it can), and the kernel's value settings
VALUE_READS = {READS: (_int_values_unsupported, _int_values), E8P: (_e8p_values_unsupported, _e8p_values)}


def fused_unsupported(key, value, head_dim: int, group: int) -> Optional[str]:
    """Why the fused kernel cannot serve the codecs ``key`` and ``value`` (:class:`~kvcx.codecs.base.Codec`; None
    when it can; ``group``: query heads per KV head)."""
    if key.codec_id not in READS_KEYS or value.codec_id not in VALUE_READS:
        return ("fused attention reads IntCodec codes (and keys with a width per channel, values in E8P records), "
                f"not {key.codec_id!r} keys and {value.codec_id!r} values")
    widths = key.codec_id != READS
    if not widths and key.bits not in FUSED_BITS:
        return f"fused attention reads 2-, 3- and 4-bit codes (keys {key.bits} bits)"
    if head_dim % 16 or head_dim > ATTN_MAX_D:
        return f"fused attention needs a head dim that is a multiple of 16 up to {ATTN_MAX_D}, got {head_dim}"
    if group < 1 or group > ATTN_MAX_GROUP:
        return f"fused attention serves 1 to {ATTN_MAX_GROUP} query heads per KV head, got {group}"
    if getattr(key, "axis", None) == "token" and key.group_size % head_dim:
        return (f"fused attention needs per-token key groups of whole tokens (group size {key.group_size} is not a "
                f"multiple of head dim {head_dim})")
    return VALUE_READS[value.codec_id][0](value, head_dim)


def splits(slabs: int, tokens: int, threads: int) -> int:
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
        self.array = EMPTY_F32_2

    def get(self, rows: int, cols: int) -> np.ndarray:
        if self.array.shape[0] < rows or self.array.shape[1] != cols:
            self.array = np.empty((max(rows, self.array.shape[0] if self.array.shape[1] == cols else 0), cols),
                                  dtype=np.float32)
        return self.array

    @property
    def nbytes(self) -> int:
        return int(self.array.nbytes)


def bind(key, value, B: int, Hkv: int, R: int, D: int, keys, values, head: tuple, Tq: int,
         workspace: Workspace, threads: int, nq: int = 1):
    """The kernel bound to one layer's packed stores (``keys``: a :class:`~kvcx.cache.store.PackedStore` or
    the store its codec keeps, which names the kernel's key settings and arrays; ``values``: codes [N, bytes],
    FP16 scales, zero points or None), its head rows (exact float32 [N, nh, D] each) and ``Tq``
    packed positions after them, for steps of ``nq`` query tokens of ``R`` query heads per KV head; the work
    split for ``threads``. Call ``run`` on it once per step."""
    rows = R * nq
    nsplit = splits(B * Hkv, Tq * max(1, rows // ATTN_TILE_ROWS), threads)
    settings = keys.kernel_settings(key)
    vset = {"v_group": D, "v_bits": 4, **VALUE_READS[value.codec_id][1](value)}   # (E8P: one record a token)
    # values through a float tile: several groups a token, or E8P records (attn.h's kvcx_attn_vtile)
    vtile = vset["v_group"] < D or vset.get("v_e8p", False)
    work = workspace.get(B * Hkv * nsplit, kernel.work_floats(rows, D, settings.get("k_widths", False), vtile))
    attn = kernel.AttnKernel(B=B, Hkv=Hkv, R=rows, D=D, nq=nq, **vset, **settings)
    attn.bind(vc=values.codes, vs=values.scales.view(np.uint16),
              vz=values.zeros.view(np.uint16) if values.zeros is not None else EMPTY_U16,
              hk=head[0], hv=head[1], Tq=Tq, work=work, nsplit=nsplit, **keys.kernel_keys(key))
    return attn
