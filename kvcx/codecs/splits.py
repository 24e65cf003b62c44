"""How the fused decode attention splits each slab's packed tokens (flash-decoding): a pure function of the step's
shape, the GPU's program slots and a program's fixed cost, used by :func:`kvcx.codecs.gpu_attn.split_tokens`.
"""
import functools


@functools.lru_cache(maxsize=1024)
def split_tiles(slabs: int, tiles: tuple, slots: int, program_tiles: float) -> int:
    """Tiles a split (flash-decoding) for ``slabs`` slabs that each read spans of ``tiles`` tiles (a span's splits:
    its tiles over this, rounded up), when ``slots`` programs run at once (``programs_per_sm`` of
    :class:`kvcx.codecs.gpu_attn.LaunchSettings` a multiprocessor): the least time in tiles, waves of programs
    (their count over ``slots``, rounded up) times the tiles a program reads and ``program_tiles``, a program's own
    fixed time (its query, first loads, outputs: the settings' ``program_tiles``); more splits (a longer merge)
    only for 3 % less of it.
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
