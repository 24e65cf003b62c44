"""What the GPU benches share (bench_gpu.py, profile_gpu.py, sass_gpu.py and their tests): the device and its
timers, one layer's decode case at Llama-3-8B's attention shapes, and the attention kernel's launch settings as the
--variants / --tune rows name them."""
from __future__ import annotations

import collections
import os
import statistics
import sys
import time

from kvcx.codecs.gpu_attn import LaunchSettings

SCHEME = "kvcx"
HQ, HKV, D = 32, 8, 128
RESIDUAL = 32


def setup_device(smoke: bool):
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")   # before the kernels are first imported
    return torch, torch.device("cuda" if torch.cuda.is_available() else "cpu")


_FLUSH = {}


def timer(torch, dev, fn, reps: int, warmup: int = 3) -> float:
    """Median seconds of fn(): CUDA events on a GPU (the L2 cache flushed before each run, outside the timed
    region: a packed store of a few tens of MiB would otherwise be read from the 50 MB L2), perf_counter
    elsewhere."""
    for _ in range(warmup if reps > 1 else 1):
        fn()
    times = []
    for _ in range(reps):
        if dev.type == "cuda":
            flush = _FLUSH.setdefault("buf", torch.empty(256 * 2**20, dtype=torch.int8, device=dev))
            flush.zero_()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def capture(torch, fn, warmup: int = 3):
    """``fn`` captured in a CUDA graph, after ``warmup`` runs on a side stream (as torch.cuda.graph wants)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def steps_per_second(torch, dev, step, steps: int) -> float:
    """``steps`` calls of ``step`` one after another, timed from the host (the device synchronised on each side)."""
    if dev.type == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(steps):
        step()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    return steps / (time.perf_counter() - t)


def graph_timer(torch, dev, fn, reps: int):
    """Median seconds of replaying fn() captured in a CUDA graph (no Python or launch overhead between its
    kernels, as serving engines run decode steps); None off CUDA or where fn cannot be captured."""
    if dev.type != "cuda":
        return None
    try:
        graph = capture(torch, fn)
    except Exception as exc:  # reported, and the table says n/a
        print(f"CUDA graph capture failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return None
    return timer(torch, dev, graph.replay, reps)


def kernel_times(torch, dev, step, steps: int) -> list:
    """[(kernel name, launches a step, mean us a step)] of ``step`` over ``steps`` profiled steps, longest first."""
    from torch.profiler import ProfilerActivity, profile

    flush = torch.empty(256 * 2**20, dtype=torch.int8, device=dev)
    acts = [ProfilerActivity.CUDA] if dev.type == "cuda" else [ProfilerActivity.CPU]
    with profile(activities=acts) as prof:
        for _ in range(steps):
            flush.zero_()
            step()
        if dev.type == "cuda":
            torch.cuda.synchronize()
    got = collections.defaultdict(lambda: [0, 0.0])
    for ev in prof.events():
        on_device = getattr(ev, "device_type", None) == torch.autograd.DeviceType.CUDA
        if (dev.type == "cuda") != on_device or ev.name.startswith(("ProfilerStep", "cudaDevice")):
            continue
        if dev.type != "cuda" and ev.cpu_parent is not None:   # the interpreter: top-level calls only
            continue
        low = ev.name.lower()
        if ev.name in ("aten::zero_", "aten::fill_") or "memset" in low or ("fill" in low and "signed char" in low):
            continue     # the flush (int8 zeros: a fill of 256 MiB), not the step
        t = ev.device_time if dev.type == "cuda" else ev.cpu_time
        got[ev.name][0] += 1
        got[ev.name][1] += t
    rows = [(name[:70], n / steps, us / steps) for name, (n, us) in got.items()]
    return sorted(rows, key=lambda r: -r[2])


def kernels_us(torch, dev, step, steps: int = 10) -> float:
    """The device time of ``step``'s kernels, summed (:func:`kernel_times`), in us."""
    return sum(us for _, _, us in kernel_times(torch, dev, step, steps))


def rate(r) -> str:
    return "n/a" if r is None else f"{r:.1f}"


def us(t) -> str:
    return "n/a" if t is None else f"{t * 1e6:.1f}"



def case(torch, dev, cfg, B, S, hq, hkv, d, seed):
    """One layer's decode step at S tokens: random BF16 keys and values [B, hkv, S + RESIDUAL, d] and the query
    [B, hq, 1, d], the first S tokens packed (:func:`build_store`), the rest the residual: (q, K, V, store, rk,
    rv)."""
    g = torch.Generator(device=dev).manual_seed(seed)
    K, V = (torch.randn(B, hkv, S + RESIDUAL, d, device=dev, dtype=torch.bfloat16, generator=g) for _ in "kv")
    q = torch.randn(B, hq, 1, d, device=dev, dtype=torch.bfloat16, generator=g)
    store = build_store(torch, dev, cfg, K[:, :, :S], V[:, :, :S])
    return q, K, V, store, K[:, :, S:].contiguous(), V[:, :, S:].contiguous()


def build_store(torch, dev, cfg, K, V):
    """A layer's device store as KvcxCache builds it: the prompt's first half as its first chunk (with the sink,
    so a partial channel block), the rest as the next chunk: two segments, as in use."""
    from kvcx.cache.device_store import DevicePackedKV
    from kvcx.codecs import get_codec

    kc, vc = cfg.key.with_backend("triton"), cfg.value.with_backend("triton")
    kn, vn = (get_codec({**c.get_config(), "sinks": 0}).with_backend("triton") for c in (kc, vc))
    B, H, S, _ = K.shape
    store = DevicePackedKV(B, H, K.shape[-1], dev)
    first = S // 2
    store.append(kc.encode(K[:, :, :first].contiguous()), vc.encode(V[:, :, :first].contiguous()))
    store.append(kn.encode(K[:, :, first:].contiguous()), vn.encode(V[:, :, first:].contiguous()))
    return store



# Settings the H100 runs of 2026-11-27 timed and found slower everywhere (4, 12 and 16 programs a multiprocessor of
# one warp, 4 warps, TF32 passes, the first tile early, Triton's default stages at 8 programs a multiprocessor where 6
# fit: docs/results/history/gpu-h100-fast-mode-run1.md, gpu.md; the merge inside the attention kernel:
# docs/results/history/gpu-h100-merge-in-kernel.md) are no longer timed. Each is a kvcx.codecs.gpu_attn.LaunchSettings, passed
# to the launches it times (nothing in the package is set); str() names what differs from the package's defaults.
SETTINGS = [LaunchSettings(block_tokens=32, warps=4, dot="", stages=None, programs_per_sm=4,
                           merge_pdl=False),                            # FP32 sums (the error reference)
            LaunchSettings(),                                           # the default: FP16 tensor cores, one warp,
            LaunchSettings(merge_pdl=False),                            # the merge a dependent launch
            # what a batch-1 step waits on (docs/results/gpu-sass.md, the sm_90 SASS of the default's loop): each
            # tile's scales are loaded where they are first used (a full memory latency, twice a tile), and at two
            # stages Triton issues the next tile's codes at the loop's end and waits for them at its start (nothing
            # of a tile's compute hides its own loads; only the other programs of a multiprocessor do). "prefetch"
            # loads each tile's scales with the tile before it; three stages keep the next tile's codes in flight
            # (33 KB of shared memory: 6 one-warp programs a multiprocessor); 32-token tiles at four stages keep 8
            LaunchSettings(prefetch=True),
            LaunchSettings(prefetch=True, stages=3, programs_per_sm=6),
            LaunchSettings(block_tokens=32, prefetch=True, stages=4),
            # two warps a program at 128 registers: 16 warps a multiprocessor where one warp's 255 registers let 8
            # run (+14 % instructions a token, a 24-byte spill)
            LaunchSettings(warps=2, max_registers=128),
            # the merge in one pass over a batch-1 step's splits (132 on an H100): 8 warps, 256 splits at a time;
            # and with the scales ahead (the attention's and the merge's changes together, should both pay)
            LaunchSettings(merge_warps=8, merge_splits=256),
            LaunchSettings(prefetch=True, merge_warps=8, merge_splits=256),
            LaunchSettings(prefetch=True, stages=3, programs_per_sm=6, merge_warps=8, merge_splits=256),
            LaunchSettings(warps=2, dot="int8x3", stages=None, programs_per_sm=4)]       # the exact mode


def describe(launch: LaunchSettings) -> str:
    """A launch setting in words (a table cell or a sentence)."""
    s = launch
    return (f"{s.block_tokens} tokens, {s.program_warps(s.dot)} warps, {s.dot or 'FP32 sums'}"
            f"{', prefetch' if s.prefetch else ''}{f', {s.stages} stages' if s.stages else ''}, "
            f"{s.programs_per_sm} programs/SM{f', at most {s.max_registers} registers' if s.max_registers else ''}"
            f"{', first tile early' if s.early_tile else ''}{', merge launched early' if s.merge_pdl else ''}, "
            f"merge {s.merge_warps} warps x {s.merge_splits} splits")
