"""How the fused decode attention is launched: the splits of a slab's packed tokens (flash-decoding) in whole waves
of programs, each product mode's warps."""
import itertools

import pytest

from kvcx.codecs import KVConfig, gpu_attn, tensors
from kvcx.codecs.splits import split_tiles
from kvcx.errors import CodecError


def _time(slabs, tiles, slots, t):
    """Waves of programs times (tiles a program + its fixed cost), in tiles: what split_tiles minimizes."""
    splits = sum(-(-n // t) for n in tiles)
    return -(-slabs * splits // slots) * (t + gpu_attn.ATTN_PROGRAM_TILES), splits


def test_a_batch_8_step_runs_in_one_wave_where_17_splits_ran_two():
    # an H100: 132 multiprocessors x 8 programs; batch 8 x 8 KV heads = 64 slabs; 32k tokens = 512 tiles of 64.
    # The rule before rounded 1056 / 64 = 16.5 splits up: 17 x 64 = 1088 programs, 32 of them a second wave
    t = split_tiles(64, (512,), 1056, gpu_attn.ATTN_PROGRAM_TILES)
    assert (t, -(-512 // t)) == (32, 16)                 # 16 splits x 64 slabs = 1024 programs: one wave
    # the two segments of a growing store: 16 tiles a split, 33 splits a slab, two whole waves (2112 programs)
    # beat one wave of 34 tiles
    t = split_tiles(64, (470, 43), 1056, gpu_attn.ATTN_PROGRAM_TILES)
    assert t == 16 and 64 * (-(-470 // t) + -(-43 // t)) == 2 * 1056
    # batch 1 keeps a wave of 4 tiles a program at 32k tokens, as before
    assert split_tiles(8, (512,), 1056, gpu_attn.ATTN_PROGRAM_TILES) == 4


@pytest.mark.parametrize("slabs,slots", [(1, 1056), (8, 1056), (64, 1056), (100, 1056), (512, 1056), (2000, 1056),
                                         (8, 64), (3, 7)])
def test_the_choice_is_within_3_percent_of_every_split_and_prefers_fewer(slabs, slots):
    for tiles in [(1,), (5,), (64,), (512,), (470, 43), (2048,), (1000, 999), (7, 3000)]:
        t = split_tiles(slabs, tiles, slots, gpu_attn.ATTN_PROGRAM_TILES)
        assert 1 <= t <= max(tiles)
        chosen, splits = _time(slabs, tiles, slots, t)
        every = [_time(slabs, tiles, slots, u) for u in range(1, max(tiles) + 1)]
        best = min(c for c, _ in every)
        assert chosen <= best / 0.97 + 1e-9, (slabs, tiles, slots, t)
        # no choice with fewer splits is as fast
        assert not any(c <= chosen and s < splits for c, s in every), (slabs, tiles, slots, t)


def test_split_tokens_rounds_to_whole_tiles_and_takes_each_span(monkeypatch):
    bt = gpu_attn.ATTN_BLOCK_TOKENS
    assert gpu_attn.split_tokens(8, 10_000, per_split=bt + 1) == 2 * bt
    assert gpu_attn.split_tokens(8, 10_000, per_split=1) == bt
    monkeypatch.setattr(tensors, "multiprocessors", lambda: 132)
    monkeypatch.setattr(gpu_attn, "ATTN_PROGRAMS_PER_SM", 8)
    for spans in ([32 * 1024], [470 * bt - 5, 43 * bt], [0, 3 * bt]):
        tiles = tuple(-(-n // bt) for n in spans if n)
        assert gpu_attn.split_tokens(64, spans, None) == max(gpu_attn.ATTN_SPLIT_TOKENS,
                                                        split_tiles(64, tiles, 1056, gpu_attn.ATTN_PROGRAM_TILES) * bt)
    assert gpu_attn.split_tokens(64, 32 * 1024, None) == gpu_attn.split_tokens(64, [32 * 1024], None)


def test_splits_stay_cheap_to_choose():
    # a 1M-token context: a binary search a wave count, not a scan of 16k tile counts
    split_tiles.cache_clear()
    for slabs, t in itertools.product((1, 8, 64, 256), (16384,)):
        assert split_tiles(slabs, (t,), 1056, gpu_attn.ATTN_PROGRAM_TILES) >= 1
    assert split_tiles.cache_info().misses == 4


def test_each_product_mode_launches_with_its_own_warps(monkeypatch):
    """ATTN_WARPS None (the default): the mode a launch runs picks its warps (the fast mode one, the exact mode two:
    at one its registers spill), also where per-token keys fall back from "fp16" to two TF32 passes; a number
    overrides every mode; one that is not a program's warps is refused by name."""
    kvcx, ref = KVConfig.from_scheme("kvcx"), KVConfig.from_scheme("reference")

    def warps(cfg, dot):
        const = gpu_attn.attention_constexprs(cfg.key, cfg.value, 4, 128, dot, 64, False, False)
        return gpu_attn.attention_options(const)["num_warps"]

    monkeypatch.setattr(gpu_attn, "ATTN_WARPS", None)
    assert (warps(kvcx, "fp16"), warps(kvcx, "int8x3"), warps(ref, "fp16"), warps(kvcx, "")) == (1, 2, 2, 4)
    monkeypatch.setattr(gpu_attn, "ATTN_WARPS", 4)
    assert warps(kvcx, "fp16") == warps(kvcx, "int8x3") == 4
    monkeypatch.setattr(gpu_attn, "ATTN_WARPS", 3)
    with pytest.raises(CodecError, match=r"ATTN_WARPS.*1, 2, 4, 8 or 16"):
        warps(kvcx, "fp16")
