"""How the fused decode attention reads a store (:mod:`kvcx.codecs.gpu`): its spans of packed tokens, the splits of
each slab's tokens (flash-decoding: a pure function of the step's shape, the GPU's program slots and a program's
fixed cost, used by :func:`kvcx.codecs.gpu.split_tokens`), the in-kernel merge's groups, the kernel's padded rows.
"""
import functools
import math
from dataclasses import dataclass


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


@dataclass(frozen=True)
class Span:
    """Packed keys and values of the same tokens for :func:`attend_spans`: their spans and codecs, and the mask
    column of their first token."""

    keys: PackedSpan
    values: PackedSpan
    key_codec: object
    value_codec: object
    mask_off: int


def pow2(n: int) -> int:
    """n rounded up to a power of two, at least 2 (a Triton block's extent)."""
    return max(2, 1 << (max(1, n) - 1).bit_length())


def attention_rows(R: int, NG: int, dot: str) -> int:
    """The query rows RP the attention kernel pads R to, for NG value groups a token: its products have RP x NG
    rows (each query row once per group), and tl.dot needs at least 16, so with ``dot`` the groups fill rows that
    would otherwise be padding."""
    return max(pow2(R), -(-16 // NG)) if dot else pow2(R)


def merge_groups(splits: int) -> tuple:
    """(splits a group, counts a slab) of the in-kernel merge over a slab's ``splits``: groups of about the square
    root, so that a group's last program and the slab's last each read about as many; a count a group, one a slab."""
    gs = max(1, math.isqrt(max(1, splits) - 1) + 1)
    return gs, -(-splits // gs) + 1


@functools.lru_cache(maxsize=1024)
def split_tiles(slabs: int, tiles: tuple, slots: int, program_tiles: float) -> int:
    """Tiles a split (flash-decoding) for ``slabs`` slabs that each read spans of ``tiles`` tiles (a span's splits:
    its tiles over this, rounded up), when ``slots`` programs run at once (``kvcx.codecs.gpu.ATTN_PROGRAMS_PER_SM``
    a multiprocessor): the least time in tiles, waves of programs (their count over ``slots``, rounded up) times
    the tiles a program reads and ``program_tiles``, a program's own fixed time (its query, first loads, outputs:
    ``kvcx.codecs.gpu.ATTN_PROGRAM_TILES``); more splits (a longer merge) only for 3 % less of it.
    Without the rounding of the waves a step of 17 splits a slab where 16.5 fit ran a second wave of a few
    programs behind the first (an H100 at batch 8, 32k tokens: 173 us, where 16 programs a multiprocessor, two
    whole waves of 16 tiles, took 159). A binary search a wave count; cached by the arguments (they change once in
    a tile's tokens of decoding)."""
    def splits(t: int) -> int:
        return sum(-(-n // t) for n in tiles)

    c = program_tiles
    best, top, waves = None, max(tiles), -(-slabs * len(tiles) // slots)   # at least a split a span
    while best is None or waves * (1 + c) < 0.97 * best[0]:   # a program reads a tile at least
        cap = waves * slots // slabs                   # splits a slab within this many waves
        lo, hi = 1, top
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if splits(mid) <= cap else (mid + 1, hi)
        if best is None or waves * (lo + c) < 0.97 * best[0]:   # more splits: 3 % less time at least
            best = (waves * (lo + c), lo)
        if lo == 1:
            break
        waves += 1
    return best[1]
