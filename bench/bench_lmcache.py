"""kvcx as an LMCache serde vs LMCache's own fp8 serde, on the same real KV chunks, in one run.

    python -m bench.bench_lmcache [--chunks 8] [--repeat 5] [--markdown out.md]

Chunks: the embedded SmolLM2-135M's KV cache of a WikiText-2 passage, cut into LMCache chunks of 256
tokens x 30 layers (KV_2LTD [2, 30, 256, 192], BF16: 5.9 MB each). Every serde runs on the same
chunks through LMCache's serializer interface (CPU memory objects):

- bytes stored per chunk, and the ratio vs BF16;
- RMSE, relative RMSE and SNR of the decoded chunk vs the original;
- serialize and deserialize GB/s (of BF16 chunk bytes), best of --repeat rounds in which every
  serde and thread count is timed in turn, on 1 and 2 threads (kvcx: its ``threads`` option; fp8:
  torch.set_num_threads);
- the throughput of LMCache's own pipeline: an AsyncSerdeProcessor with 2 workers, one chunk per
  task, 1 thread per task (kvcx ``threads: 1``; torch.set_num_threads(1));
- a store + load round trip of all chunks through LMCache's SerdeL2AdapterWrapper over a real
  CPU L1 manager and the FS adapter (wall time, files' bytes on disk).

Rows: kvcx's default scheme, kvcx's reference scheme (symmetric INT4, groups of 64: the 4-bit uniform
baseline), and LMCache's fp8 (float8_e4m3fn). Targets: kvcx >= 3.5x vs BF16 at lower error than the
4-bit uniform baseline, serialize/deserialize at least as fast as fp8 on CPU.
"""
from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent

DEFAULT_DATA = HERE.parents[1] / "shared/data/wikitext-2-raw/wiki.test.raw"
TOKENS = 256


def real_chunks(n: int, dataset_file):
    import torch

    import kvcx.integrations.lmcache_local as ls
    from kvcx.quality.models import load_dataset_text, load_model_and_tokenizer

    model, tok, name = load_model_and_tokenizer(cpu=True)
    ids = tok(load_dataset_text(dataset_file)[:200000])["input_ids"][:n * TOKENS]
    with torch.inference_mode():
        cache = model(torch.tensor(ids)[None], use_cache=True).past_key_values
    chunks = []
    for c in range(n):
        sl = slice(c * TOKENS, (c + 1) * TOKENS)
        x = torch.stack([torch.stack([layer.keys[0, :, sl], layer.values[0, :, sl]]) for layer in cache.layers], dim=1)
        x = x.permute(0, 1, 3, 2, 4).reshape(2, len(cache.layers), TOKENS, -1).contiguous().bfloat16()
        chunks.append(ls.to_numpy(x).copy())
    return chunks, name


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--dataset-file", type=Path, default=DEFAULT_DATA)
    ap.add_argument("--markdown", type=Path, default=None)
    args = ap.parse_args(argv)

    import torch
    from lmcache.v1.distributed.serde.fp8 import Fp8QuantizationDeserializer, Fp8QuantizationSerializer

    import kvcx.integrations.lmcache as kl
    import kvcx.integrations.lmcache_local as ls
    from kvcx.integrations.lmcache_local import memobj

    kl.register()
    chunks, model_name = real_chunks(args.chunks, args.dataset_file)
    shape = chunks[0].shape
    lay = ls.layout(shape)
    keys = [ls.key(i) for i in range(len(chunks))]
    total = sum(c.nbytes for c in chunks)
    serdes = [
        ("kvcx default (`scheme: kvcx`)", "kvcx", {"scheme": "kvcx", "head_dim": 64}),
        ("kvcx reference: INT4 sym g64 (4-bit uniform baseline)", "kvcx", {"scheme": "reference", "head_dim": 64}),
        ("LMCache fp8 (float8_e4m3fn)", "fp8", {"fp8_dtype": "float8_e4m3fn"}),
    ]
    rows = []
    torch_threads = torch.get_num_threads()
    # every (serde, threads) pair set up first, then timed in interleaved rounds (best of --repeat each),
    # so that a noisy moment of this shared machine does not favour one row
    runs = []
    for label, kind, opts in serdes:
        r = {"label": label, "kind": kind, "opts": opts}
        rows.append(r)
        for th in (1, 2):
            if kind == "kvcx":
                codec, _ = kl.chunk_codec_from_options({**opts, "threads": th})
                ser, de = kl.KvcxSerializer(codec), kl.KvcxDeserializer(codec)
            else:
                ser = Fp8QuantizationSerializer(torch.float8_e4m3fn)
                de = Fp8QuantizationDeserializer(torch.float8_e4m3fn)
            n = ser.estimate_serialized_size(lay)
            bufs = [np.zeros(n, np.uint8) for _ in chunks]
            outs = [np.zeros_like(c) for c in chunks]
            r["outs"] = outs
            run = {"row": r, "th": th, "ser": ser, "de": de, "srcs": [memobj(c) for c in chunks],
                   "dsts": [memobj(b) for b in bufs], "outobjs": [memobj(o) for o in outs], "fp8": kind != "kvcx"}
            runs.append(run)

    def serialize(run):
        if run["fp8"]:
            torch.set_num_threads(run["th"])
        run["row"]["bytes"] = [run["ser"].serialize(s, d, k) for s, d, k in zip(run["srcs"], run["dsts"], keys)][0]

    def deserialize(run):
        if run["fp8"]:
            torch.set_num_threads(run["th"])
        for s, d, k in zip(run["dsts"], run["outobjs"], keys):
            run["de"].deserialize(s, d, k)

    for run in runs:  # warm up, and fill every output once
        serialize(run)
        deserialize(run)
    for what, fn in (("ser", serialize), ("de", deserialize)):
        best_t = {id(run): math.inf for run in runs}
        for _ in range(args.repeat):
            for run in runs:
                t = time.perf_counter()
                fn(run)
                best_t[id(run)] = min(best_t[id(run)], time.perf_counter() - t)
        for run in runs:
            run["row"][(what, run["th"])] = total / best_t[id(run)] / 1e9
    torch.set_num_threads(torch_threads)

    # LMCache's own pipeline: an AsyncSerdeProcessor with 2 workers, one chunk per task, 1 thread per task
    # (kvcx threads=1, torch.set_num_threads(1)): the throughput a store sees when chunks arrive in batches
    from lmcache.v1.distributed.serde import AsyncSerdeProcessor

    for r in rows:
        if r["kind"] == "kvcx":
            codec, _ = kl.chunk_codec_from_options({**r["opts"], "threads": 1})
            ser, de = kl.KvcxSerializer(codec), kl.KvcxDeserializer(codec)
        else:
            torch.set_num_threads(1)
            ser, de = Fp8QuantizationSerializer(torch.float8_e4m3fn), Fp8QuantizationDeserializer(torch.float8_e4m3fn)
        proc = AsyncSerdeProcessor(ser, de, max_workers=2)
        n = ser.estimate_serialized_size(lay)
        srcs = [memobj(c) for c in chunks]
        dsts = [memobj(np.zeros(n, np.uint8)) for _ in chunks]
        outs = [memobj(np.zeros_like(c)) for c in chunks]

        def pipeline(submit, query, a, b):
            ids = [submit([x], [y], [k]) for x, y, k in zip(a, b, keys)]
            pending = set(ids)
            while pending:
                pending = {i for i in pending if query(i) is None}
                if pending:
                    time.sleep(0.0002)

        for what, fn in (("pser", lambda: pipeline(proc.submit_serialize, proc.query_serialize_result, srcs, dsts)),
                         ("pde", lambda: pipeline(proc.submit_deserialize, proc.query_deserialize_result, dsts, outs))):
            fn()
            t_best = math.inf
            for _ in range(args.repeat):
                t = time.perf_counter()
                fn()
                t_best = min(t_best, time.perf_counter() - t)
            r[what] = total / t_best / 1e9
        proc.close()
    torch.set_num_threads(torch_threads)

    for r in rows:
        label, kind, opts, outs = r["label"], r["kind"], r["opts"], r["outs"]
        ss = se = 0.0
        for c, o in zip(chunks, outs):
            x, y = c.astype(np.float64), o.astype(np.float64)
            ss += (x * x).sum()
            se += ((x - y) ** 2).sum()
        r["rmse"] = math.sqrt(se / sum(c.size for c in chunks))
        r["rel"] = math.sqrt(se / ss)
        r["snr"] = 10 * math.log10(ss / se)
        # store + load through LMCache: SerdeL2AdapterWrapper over a real L1 manager and the FS adapter
        with tempfile.TemporaryDirectory() as d:
            l1 = ls.make_l1(1 << 30)
            w = ls.make_wrapper(l1, "fs", serde=(kind, {**opts, "threads": 2} if kind == "kvcx" else opts),
                                base_path=d)
            try:
                t = time.perf_counter()
                ok, _ = ls.store(l1, w, keys, chunks)
                t_store = time.perf_counter() - t
                t = time.perf_counter()
                hits, _ = ls.load(w, keys, shape)
                t_load = time.perf_counter() - t
            finally:
                w.close()
                l1.close()
            disk = sum(p.stat().st_size for p in Path(d).rglob("*") if p.is_file())
        assert ok and hits == len(keys), (label, ok, hits)
        r["fs"] = (t_store, t_load, disk)
        print(f"{label}: done", file=sys.stderr)

    lines = [f"{len(chunks)} real KV chunks of {model_name}: KV_2LTD {list(shape)} BF16, {chunks[0].nbytes:,} B each "
             f"({TOKENS} tokens x {shape[1]} layers, WikiText-2). GB/s of BF16 chunk bytes, best of {args.repeat}; "
             "FS: LMCache SerdeL2AdapterWrapper + CPU L1Manager + FSL2Adapter, all chunks stored then loaded.", "",
             "| serde | bytes / chunk | ratio vs BF16 | RMSE | relative RMSE | SNR dB | serialize 1T | serialize 2T | "
             "deserialize 1T | deserialize 2T | serialize, deserialize: 2 workers x 1T | FS store + load (s) | "
             "bytes on disk |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        ts, tl, disk = r["fs"]
        lines.append(f"| {r['label']} | {r['bytes']:,} | {chunks[0].nbytes / r['bytes']:.2f}x | {r['rmse']:.4f} | "
                     f"{r['rel']:.4f} | {r['snr']:.2f} | {r[('ser', 1)]:.2f} | {r[('ser', 2)]:.2f} | "
                     f"{r[('de', 1)]:.2f} | {r[('de', 2)]:.2f} | {r['pser']:.2f}, {r['pde']:.2f} | "
                     f"{ts:.3f} + {tl:.3f} | {disk:,} |")
    k, ref, fp8 = rows
    lines += ["", f"kvcx default vs fp8: {fp8['bytes'] / k['bytes']:.2f}x fewer bytes; serialize "
              f"{k[('ser', 1)] / fp8[('ser', 1)]:.2f}x (1T) / {k[('ser', 2)] / fp8[('ser', 2)]:.2f}x (2T), "
              f"deserialize {k[('de', 1)] / fp8[('de', 1)]:.2f}x / {k[('de', 2)] / fp8[('de', 2)]:.2f}x fp8's speed; "
              f"through LMCache's AsyncSerdeProcessor with 2 workers: serialize {k['pser'] / fp8['pser']:.2f}x, "
              f"deserialize {k['pde'] / fp8['pde']:.2f}x; "
              f"relative RMSE {k['rel']:.4f} vs the 4-bit uniform baseline's {ref['rel']:.4f}."]
    table = "\n".join(lines)
    print(table)
    if args.markdown:
        from bench.report import header

        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(header("kvcx as an LMCache serde against LMCache's fp8 serde, on the same real "
                                        "KV chunks.") + "\n" + table + "\n")


if __name__ == "__main__":
    main()
