"""Codec throughput: kvcx kernels vs a vectorised NumPy implementation of the same math vs a copy.

    python -m bench.bench_codec [--mib 64] [--repeat 5] [--markdown out.md]

Throughput is GB/s of FP16 input (encode) or FP16 output (decode). Every figure
comes from this run, like compared with like:

- NumPy runs on one thread (its element-wise ufuncs are single-threaded; no BLAS
  is involved), so "x NumPy" is kvcx on 1 thread over NumPy on 1 thread;
- the memory-bandwidth reference is a copy of the same buffer at the same thread
  count: ``np.copyto`` on 1 thread, and on T threads ``np.copyto`` of T slices in
  T Python threads (NumPy releases the GIL while it copies);
- encode and decode write into buffers allocated before the timing (``out=``), as the copy does;
- every figure is the best of --repeat rounds in which all of them are timed in
  turn, so noise on a shared machine hits every row alike.

Targets on a 2-core machine: encode and decode >= 10x NumPy, >= 0.4x copy, all
threads >= 1.6x one thread.
"""
from __future__ import annotations

import argparse
import threading
import time
from pathlib import Path

import numpy as np

from kvcx.codecs import IntCodec, WidthCodec, get_codec
from kvcx.codecs.runtime import build_info, resolve_threads


def best(fn, repeat):
    fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def threaded_copy(dst, src, nthreads):
    """np.copyto of nthreads slices in nthreads Python threads (the GIL is released while copying)."""
    d, s = dst.reshape(-1), src.reshape(-1)
    bounds = np.linspace(0, d.size, nthreads + 1).astype(np.int64)
    ts = [threading.Thread(target=np.copyto, args=(d[a:b], s[a:b])) for a, b in zip(bounds[:-1], bounds[1:])]
    for t in ts:
        t.start()
    for t in ts:
        t.join()


def numpy_encode(x, g=64):
    """The reference scheme in vectorised NumPy: symmetric, groups of g, FP16 scales, nibble packing."""
    v = x.reshape(-1, g).astype(np.float32)
    s16 = (np.abs(v).max(axis=1) / np.float32(7)).astype(np.float16)
    s = s16.astype(np.float32)[:, None]
    q = np.clip(np.rint(v / np.where(s == 0, 1, s)), -8, 7).astype(np.int8) + 8
    q = q.reshape(-1).astype(np.uint8)
    return (q[0::2] | (q[1::2] << 4)), s16


def numpy_decode(codes, s16, shape, g=64):
    q = np.empty(codes.size * 2, np.float32)
    q[0::2] = codes & 0x0F
    q[1::2] = codes >> 4
    return ((q.reshape(-1, g) - 8) * s16.astype(np.float32)[:, None]).astype(np.float16).reshape(shape)


OPTIONS = [
    ("reference: sym g64 per-token", dict(scheme="symmetric")),
    ("asym g64 per-token", dict(scheme="asymmetric")),
    ("asym g64 per-channel (keys)", dict(scheme="asymmetric", axis="channel")),
    ("asym per-channel + 1 sink", dict(scheme="asymmetric", axis="channel", sinks=1)),
    ("sym g64 + hadamard", dict(scheme="symmetric", rotate=True)),
    ("asym g64 + hadamard (plan option value b4a)", dict(scheme="asymmetric", rotate=True)),
    ("3-bit asym g64", dict(scheme="asymmetric", bits=3)),
    ("2-bit asym g64", dict(scheme="asymmetric", bits=2)),
    ("8-bit sym g64", dict(scheme="symmetric", bits=8)),
    ("kvcx3 keys: 3-bit asym per-channel + sink", dict(scheme="asymmetric", axis="channel", sinks=1, bits=3)),
    ("kvcx3 values: 3-bit sym + hadamard + sink", dict(scheme="symmetric", rotate=True, bits=3, sinks=1)),
    ("kvcx2 keys: 2-bit asym per-channel + sink", dict(scheme="asymmetric", axis="channel", sinks=1, bits=2)),
    ("kvcx2 values: 2-bit asym + hadamard + sink", dict(scheme="asymmetric", rotate=True, bits=2, sinks=1)),
    # the presets' other plan options (README "Low bits")
    ("plan option key b3g128: 3-bit asym per-channel g128 + sink",
     dict(scheme="asymmetric", axis="channel", sinks=1, bits=3, group_size=128)),
    ("plan option key b4g128: 4-bit asym per-channel g128 + sink",
     dict(scheme="asymmetric", axis="channel", sinks=1, bits=4, group_size=128)),
    ("plan option value b3a: 3-bit asym + hadamard + sink", dict(scheme="asymmetric", rotate=True, bits=3, sinks=1)),
    # kvcx.codecs.WidthCodec: a width per channel (kvcx2w's keys; the 2.47 plan's at 1.9375 bits)
    ("kvcx2w keys: a width per channel, mean 2 bits, g32 + sink", ("widths", dict(bits=2.0, group_size=32, sinks=1))),
    # the engine formats (kvcx.codecs.engine): what validating a deployed format costs per cache
    ("llama.cpp q4_0 (--scheme q4_0)", ("codec", {"id": "llama.cpp", "type": "q4_0"})),
    ("llama.cpp q4_0 + its rotation (--scheme q4_0-rot)", ("codec", {"id": "llama.cpp", "type": "q4_0", "rotate": True})),
    ("llama.cpp q8_0 (--scheme q8_0)", ("codec", {"id": "llama.cpp", "type": "q8_0"})),
    ("llama.cpp q5_1 (--scheme q5_1)", ("codec", {"id": "llama.cpp", "type": "q5_1"})),
    ("vLLM fp8 e4m3, scale 1 (--scheme fp8_e4m3)", ("codec", {"id": "vllm.fp8", "format": "e4m3"})),
]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=64, help="FP16 input size in MiB (>= 64 for the targets)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--markdown", type=Path, default=None)
    args = ap.parse_args(argv)

    nthreads = resolve_threads(None)
    tokens = args.mib * 2 ** 20 // (2 * 8 * 64)  # [1, 8 heads, tokens, 64] FP16
    x = (np.random.default_rng(0).standard_normal((1, 8, tokens, 64)) * 0.5).astype(np.float16)
    gb = x.nbytes / 1e9
    dst = np.empty_like(x)
    info = build_info()
    for th in (1, nthreads):  # warm up the OpenMP thread pool and the allocator before measuring
        w = IntCodec(n_threads=th)
        w.decode(w.encode(x), out=dst)
    # every measurement (the copies, and each option's encode and decode at 1 and all threads) is timed
    # once per round, in turn, and keeps its best round: a noisy moment of a shared machine then hits
    # all of them alike instead of one row
    jobs = {("copy", 1): lambda: np.copyto(dst, x), ("copy", nthreads): lambda: threaded_copy(dst, x, nthreads)}
    for label, opts in OPTIONS:
        for th in (1, nthreads):
            c = (IntCodec(n_threads=th, **opts) if not isinstance(opts, tuple) else
                 WidthCodec(n_threads=th, **opts[1]) if opts[0] == "widths" else get_codec(opts[1], n_threads=th))
            p, q = c.encode(x), c.encode(x)
            out = np.empty_like(x)
            # into buffers that exist, as the copy and decode write into theirs (out=)
            jobs[(label, "enc", th)] = (lambda c=c, q=q: c.encode(x, out=q))
            jobs[(label, "dec", th)] = (lambda c=c, p=p, out=out: c.decode(p, out=out))
    best_t = {k: float("inf") for k in jobs}
    for _ in range(args.repeat):
        for k, fn in jobs.items():
            t = time.perf_counter()
            fn()
            best_t[k] = min(best_t[k], time.perf_counter() - t)
    copy = {th: gb / best_t[("copy", th)] for th in (1, nthreads)}
    results = [(label, {(what, th): gb / best_t[(label, what, th)] for what in ("enc", "dec") for th in (1, nthreads)})
               for label, _ in OPTIONS]
    # reading the input: kvcx reads files with preadv into memory (a file truncated while read is then an error,
    # not a SIGBUS); the previous reader encoded straight from a memory map. Both read the same page-cached file.
    import tempfile

    from kvcx.formats import safetensors as st

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "x.safetensors"
        st.save_file({"x": x}, path)
        ref2 = IntCodec(n_threads=nthreads)
        q2 = ref2.encode(x)
        offset = 8 + int.from_bytes(path.read_bytes()[:8], "little")

        def from_map():
            mm = np.memmap(path, dtype=np.float16, mode="r", offset=offset, shape=x.shape)
            ref2.encode(mm, out=q2)

        def from_read():
            with st.SafeFile(path) as f:
                ref2.encode(f.get_tensor("x"), out=q2)

        read_t = {"map": float("inf"), "read": float("inf")}
        for _ in range(args.repeat):
            for k, fn in (("map", from_map), ("read", from_read)):
                t = time.perf_counter()
                fn()
                read_t[k] = min(read_t[k], time.perf_counter() - t)
    # the NumPy baseline last: its large temporaries must not disturb the kvcx measurements
    codes, s16 = numpy_encode(x)
    np_enc = gb / best(lambda: numpy_encode(x), max(1, args.repeat // 2))
    np_dec = gb / best(lambda: numpy_decode(codes, s16, x.shape), max(1, args.repeat // 2))
    ref = IntCodec(scheme="symmetric")
    assert np.array_equal(ref.encode(x).codes, codes), "NumPy baseline and kvcx disagree"

    T = nthreads
    lines = [f"{x.nbytes / 2 ** 20:.0f} MiB FP16 ([1, 8, {tokens}, 64]); OpenMP {'on' if info['openmp'] else 'off'}, "
             f"{T} threads; SIMD: {' '.join(info['simd'])}.",
             f"copy: {copy[1]:.2f} GB/s on 1 thread (np.copyto), {copy[T]:.2f} GB/s on {T} threads; NumPy reference "
             f"scheme on 1 thread: encode {np_enc:.3f} GB/s, decode {np_dec:.3f} GB/s.", "",
             f"| setting | encode 1T | encode {T}T | decode 1T | decode {T}T | enc x NumPy (1T vs 1T) | "
             f"dec x NumPy (1T vs 1T) | enc / copy 1T | enc / copy {T}T | dec / copy 1T | dec / copy {T}T | "
             f"enc {T}T/1T | dec {T}T/1T | enc, dec time vs reference ({T}T) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    base = None
    for label, r in results:
        e1, d1, e, d = r[("enc", 1)], r[("dec", 1)], r[("enc", T)], r[("dec", T)]
        if base is None:
            base = (e, d)
        lines.append(f"| {label} | {e1:.2f} | {e:.2f} | {d1:.2f} | {d:.2f} | "
                     f"{e1 / np_enc:.0f}x | {d1 / np_dec:.0f}x | {e1 / copy[1]:.2f} | {e / copy[T]:.2f} | "
                     f"{d1 / copy[1]:.2f} | {d / copy[T]:.2f} | {e / e1:.2f} | {d / d1:.2f} | "
                     f"{base[0] / e:.2f}x, {base[1] / d:.2f}x |")
    lines += ["", f"Reading the input file, then encoding it (reference scheme, {T} threads, best of {args.repeat}): from a "
              f"memory map (the previous reader) {gb / read_t['map']:.2f} GB/s; read with preadv into memory (this "
              f"reader: a truncated file is an error, not a SIGBUS) {gb / read_t['read']:.2f} GB/s: "
              f"{read_t['read'] / read_t['map']:.2f}x the time."]
    table = "\n".join(lines)
    print(table)
    if args.markdown:
        from bench.report import header

        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(header("Codec throughput of kvcx's kernels against a copy and a NumPy "
                                        "implementation, GB/s of FP16 data.") + "\n" + table + "\n")


if __name__ == "__main__":
    main()
