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
    return -(-slabs * splits // slots) * (t + gpu_attn.DEFAULT_LAUNCH.program_tiles), splits


def test_a_batch_8_step_runs_in_one_wave_where_17_splits_ran_two():
    # an H100: 132 multiprocessors x 8 programs; batch 8 x 8 KV heads = 64 slabs; 32k tokens = 512 tiles of 64.
    # The rule before rounded 1056 / 64 = 16.5 splits up: 17 x 64 = 1088 programs, 32 of them a second wave
    t = split_tiles(64, (512,), 1056, gpu_attn.DEFAULT_LAUNCH.program_tiles)
    assert (t, -(-512 // t)) == (32, 16)                 # 16 splits x 64 slabs = 1024 programs: one wave
    # the two segments of a growing store: 16 tiles a split, 33 splits a slab, two whole waves (2112 programs)
    # beat one wave of 34 tiles
    t = split_tiles(64, (470, 43), 1056, gpu_attn.DEFAULT_LAUNCH.program_tiles)
    assert t == 16 and 64 * (-(-470 // t) + -(-43 // t)) == 2 * 1056
    # batch 1 keeps a wave of 4 tiles a program at 32k tokens, as before
    assert split_tiles(8, (512,), 1056, gpu_attn.DEFAULT_LAUNCH.program_tiles) == 4


@pytest.mark.parametrize("slabs,slots", [(1, 1056), (8, 1056), (64, 1056), (100, 1056), (512, 1056), (2000, 1056),
                                         (8, 64), (3, 7)])
def test_the_choice_is_within_3_percent_of_every_split_and_prefers_fewer(slabs, slots):
    for tiles in [(1,), (5,), (64,), (512,), (470, 43), (2048,), (1000, 999), (7, 3000)]:
        t = split_tiles(slabs, tiles, slots, gpu_attn.DEFAULT_LAUNCH.program_tiles)
        assert 1 <= t <= max(tiles)
        chosen, splits = _time(slabs, tiles, slots, t)
        every = [_time(slabs, tiles, slots, u) for u in range(1, max(tiles) + 1)]
        best = min(c for c, _ in every)
        assert chosen <= best / 0.97 + 1e-9, (slabs, tiles, slots, t)
        # no choice with fewer splits is as fast
        assert not any(c <= chosen and s < splits for c, s in every), (slabs, tiles, slots, t)


def test_split_tokens_rounds_to_whole_tiles_and_takes_each_span(monkeypatch):
    launch = gpu_attn.DEFAULT_LAUNCH
    bt = launch.block_tokens
    assert gpu_attn.split_tokens(8, 10_000, per_split=bt + 1) == 2 * bt
    assert gpu_attn.split_tokens(8, 10_000, per_split=1) == bt
    monkeypatch.setattr(tensors, "multiprocessors", lambda: 132)
    for spans in ([32 * 1024], [470 * bt - 5, 43 * bt], [0, 3 * bt]):
        tiles = tuple(-(-n // bt) for n in spans if n)
        assert gpu_attn.split_tokens(64, spans, None) == max(launch.split_tokens,
                                                        split_tiles(64, tiles, 1056, launch.program_tiles) * bt)
    assert gpu_attn.split_tokens(64, 32 * 1024, None) == gpu_attn.split_tokens(64, [32 * 1024], None)
    # the settings passed are the ones used: 32-token tiles, 4 programs a multiprocessor
    small = launch.replace(block_tokens=32, programs_per_sm=4)
    assert gpu_attn.split_tokens(8, 10_000, per_split=33, launch=small) == 64
    tiles = (-(-(32 * 1024) // 32),)
    assert gpu_attn.split_tokens(64, 32 * 1024, None, small) == max(small.split_tokens,
                                                                   split_tiles(64, tiles, 528, 0.5) * 32)


def test_splits_stay_cheap_to_choose():
    # a 1M-token context: a binary search a wave count, not a scan of 16k tile counts
    split_tiles.cache_clear()
    for slabs, t in itertools.product((1, 8, 64, 256), (16384,)):
        assert split_tiles(slabs, (t,), 1056, gpu_attn.DEFAULT_LAUNCH.program_tiles) >= 1
    assert split_tiles.cache_info().misses == 4


def test_each_product_mode_launches_with_its_own_warps():
    """warps None (the default): the mode a launch runs picks its warps (the fast mode one, the exact mode two:
    at one its registers spill), also where per-token keys fall back from "fp16" to two TF32 passes; a number
    overrides every mode; one that is not a program's warps is refused by name."""
    kvcx, ref = KVConfig.from_scheme("kvcx"), KVConfig.from_scheme("reference")

    def warps(cfg, dot, n=None):
        launch = gpu_attn.LaunchSettings(dot=dot, warps=n)
        const = gpu_attn.attention_constexprs(cfg.key, cfg.value, 4, 128, False, launch)
        return gpu_attn.attention_options(const, launch)["num_warps"]

    assert (warps(kvcx, "fp16"), warps(kvcx, "int8x3"), warps(ref, "fp16"), warps(kvcx, "")) == (1, 2, 2, 4)
    assert warps(kvcx, "fp16", 4) == warps(kvcx, "int8x3", 4) == 4
    with pytest.raises(CodecError, match=r"LaunchSettings\(warps=3\).*1, 2, 4, 8 or 16"):
        warps(kvcx, "fp16", 3)


def test_launch_settings_are_checked_when_made_and_named_by_what_differs():
    """A LaunchSettings is frozen and refuses, by field, a value no launch takes; replace() checks alike and names
    an unknown field; str() lists the fields that differ from the defaults (how a tune names its rows); the
    caches and launchers take one, or None (the defaults), and nothing else."""
    import dataclasses

    d = gpu_attn.DEFAULT_LAUNCH
    assert d == gpu_attn.LaunchSettings() and str(d) == "LaunchSettings() (the defaults)"
    s = d.replace(prefetch=True, stages=3, programs_per_sm=6)
    assert str(s) == "LaunchSettings(prefetch=True, stages=3, programs_per_sm=6)"
    assert (s.prefetch, s.stages, s.programs_per_sm, s.dot) == (True, 3, 6, "fp16") and d.prefetch is False
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.dot = ""
    for field, bad in (("dot", "fp8"), ("block_tokens", 128), ("block_tokens", 48), ("warps", 0),
                       ("merge_warps", 3), ("stages", 0), ("max_registers", 300), ("max_registers", 8),
                       ("merge_splits", 48), ("merge_splits", 1), ("split_tokens", 0), ("programs_per_sm", True),
                       ("program_tiles", -1.0), ("asm", 1), ("fp_fusion", "yes")):
        with pytest.raises(CodecError, match=rf"LaunchSettings\({field}="):
            d.replace(**{field: bad})
    with pytest.raises(CodecError, match="no field bogus"):
        d.replace(bogus=1)
    assert gpu_attn.launch_settings(None) is d and gpu_attn.launch_settings(s) is s
    with pytest.raises(CodecError, match="LaunchSettings or None"):
        gpu_attn.launch_settings({"dot": "fp16"})


def test_a_paged_tile_lies_within_its_page_and_a_per_channel_block():
    """attention_constexprs cuts the launch's tile to a paged store's page and to per-channel groups, and a paged
    launch prefetches no codes (a tile's page comes from the table)."""
    kvcx = KVConfig.from_scheme("kvcx")
    launch = gpu_attn.LaunchSettings(block_tokens=64, prefetch=True, dot="int8x3")
    assert gpu_attn.attention_constexprs(kvcx.key, kvcx.value, 4, 128, False, launch)["BT"] == \
        min(64, kvcx.key.group_size)
    paged = gpu_attn.attention_constexprs(kvcx.key, kvcx.value, 4, 128, False, launch, page=16)
    assert paged["BT"] == 16 and not paged["PREFETCH"]


@pytest.mark.parametrize("accessor,module", [("kvcx.codecs.gpu:codec_kernels", "codec"),
                                             ("kvcx.codecs.gpu_attn:attention_kernels", "attention"),
                                             ("kvcx.codecs.gpu_lattice:lattice_kernels", "lattice")])
def test_each_launcher_gets_its_kernels_from_one_import_that_names_the_extra(accessor, module, monkeypatch):
    import importlib
    import sys

    mod, name = accessor.split(":")
    get = getattr(importlib.import_module(mod), name)
    assert get() is importlib.import_module(f"kvcx.codecs.triton_kernels.{module}")
    # without triton (the module cannot be imported): the extra named, never an ImportError's traceback
    monkeypatch.setitem(sys.modules, f"kvcx.codecs.triton_kernels.{module}", None)
    with pytest.raises(CodecError, match=r"pip install 'kvcx\[gpu\]'"):
        get()
    with pytest.raises(CodecError, match="needs triton"):
        tensors.triton_kernels(module)
