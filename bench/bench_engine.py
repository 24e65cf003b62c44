"""kvcx inside a real serving engine: vLLM's CPU build with LMCache's multiprocess server, against vLLM alone and
LMCache's own serdes, on the same prompts in one run.

    python -m bench.bench_engine [--prompts 2] [--lengths 1024,2048,4096,8000] [--markdown docs/results/engine.md]
                                 [--json docs/results/engine.json]

Model: the embedded SmolLM2-135M (its GGUF converted once to a BF16 checkpoint, kvcx.quality.engine_model), served
by vLLM (eager, block size 128, prefix cache on with LMCache, off alone). Prompts: held-out WikiText-2 test
passages of each length in tokens (--prompts of each). Configurations, each on a fresh FS store:

- vLLM alone (prefix cache off): the cold prefill, and the reference continuation (64 greedy tokens, top-5
  logprobs);
- LMCache with its default serde (the raw BF16 chunk), with its fp8 serde, with kvcx (default scheme) and with
  kvcx3, all through ``kvcx lmcache-server``: every prompt sent once (computed, stored), both servers restarted,
  every prompt sent again (answered from the store).

Measured: time to first token (client side, streaming) cold and from the store; decode tokens/s; bytes stored a
token (the FS files); the store's load time (LMCache's prefetch of a prompt's chunks from L2 into L1, serde
included, from its log) as GB/s of BF16 KV; and the quality of the reloaded cache against vLLM alone: greedy
agreement over the 64 reference tokens teacher-forced (the model's choice at each position given the reference
before it, one request a position) and free-running (the positions at which two greedy continuations agree), and
the KL divergence of the first 16 positions' top-5 logprobs (over the reference's top 5, renormalised).
"""
from __future__ import annotations

import argparse
import re
import shutil
import statistics
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_DATA = HERE.parents[1] / "shared/data/wikitext-2-raw/wiki.test.raw"
CHUNK = 256
GENERATED = 64
KLD_POSITIONS = 16
TEXT_OFFSET = 300_000          # held out: past the passages the other benches and tests use


def configs():
    from kvcx.integrations import engine_local as el

    return [("vLLM alone (prefix cache off)", "alone", None),
            ("LMCache, default serde (raw BF16)", "raw", {}),
            ("LMCache, fp8 serde (float8_e4m3fn)", "fp8", {"type": "fp8", "fp8_dtype": "float8_e4m3fn"}),
            ("LMCache, kvcx (default scheme)", "kvcx", el.serde_config()),
            ("LMCache, kvcx3", "kvcx3", el.serde_config(scheme="kvcx3"))]


def stream_timing(port: int, prompt, max_tokens: int):
    """(time to first token, decode tokens/s after it) of a streamed greedy completion, client side."""
    import json
    import urllib.request

    body = {"model": "model", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "ignore_eos": True}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    t0, stamps = time.perf_counter(), []
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            if line.startswith(b"data:") and b'"text"' in line:
                stamps.append(time.perf_counter())
    if len(stamps) < 2:
        raise RuntimeError("the stream held fewer than two tokens")
    return stamps[0] - t0, (len(stamps) - 1) / (stamps[-1] - stamps[0])


_PREFETCH_MS = re.compile(r"Prefetch request completed \(L1\+L2\): (\d+)/\d+ retained keys \(\d+ L1, (\d+) L2\) "
                          r"in ([0-9.]+) ms")


def prefetches(log_text: str) -> list:
    """(chunks from L2, milliseconds) of each prefetch LMCache's server logged."""
    return [(int(m[1]), float(m[2])) for m in _PREFETCH_MS.findall(log_text)]


def run_alone(ck, prompts, work):
    """vLLM alone: the cold prefill and decode speed (prefix cache off), then the reference (prefix cache on, as
    the teacher-forced requests of the other configurations run): the greedy continuation, and the model's
    choice and top logprobs at each of its positions given the continuation before it."""
    from kvcx.integrations import engine_local as el

    out = {}
    vl = el.start_vllm(ck, log=work / "alone.log", prefix_caching=False)
    try:
        for key, ids in prompts.items():
            ttft, tps = stream_timing(vl.port, ids, GENERATED)
            out[key] = {"ttft_cold": ttft, "tps": tps}
    finally:
        vl.stop()
    vl = el.start_vllm(ck, log=work / "alone-reference.log")
    try:
        for key, ids in prompts.items():
            out[key]["tokens"] = el.complete(vl.port, ids, max_tokens=GENERATED)["choices"][0]["token_ids"]
            tf = el.teacher_forced(vl.port, ids, out[key]["tokens"])
            out[key]["tf_tokens"], out[key]["tf_top"] = tf["tokens"], tf["top_logprobs"]
    finally:
        vl.stop()
    return out


def run_lmcache(ck, prompts, serde, work, tag, reference):
    from kvcx.integrations import engine_local as el

    store = work / f"store-{tag}"
    adapters = [el.fs_adapter(store, serde or None)]
    out = {k: {} for k in prompts}

    def files():
        return {p for p in store.rglob("*") if p.is_file()}

    lm = el.start_lmcache_server(adapters, log=work / f"{tag}-lmcache-1.log", l1_gb=2)
    vl = el.start_vllm(ck, log=work / f"{tag}-vllm-1.log", lmcache_port=lm.port)
    try:
        for key, ids in prompts.items():
            before = files()
            out[key]["ttft_cold"], _ = stream_timing(vl.port, ids, 2)
            want = len(ids) // CHUNK
            deadline = time.monotonic() + 300
            while len(files() - before) < want and time.monotonic() < deadline:
                time.sleep(0.2)
            new = files() - before
            out[key]["bytes_per_token"] = sum(p.stat().st_size for p in new) / (len(new) * CHUNK)
        stored = el.lmcache_counts(lm)
    finally:
        vl.stop()
        lm.stop()
    lm = el.start_lmcache_server(adapters, log=work / f"{tag}-lmcache-2.log", l1_gb=2)
    vl = el.start_vllm(ck, log=work / f"{tag}-vllm-2.log", lmcache_port=lm.port)
    try:
        for key, ids in prompts.items():
            mark = len(prefetches(lm.log_text()))
            out[key]["ttft_store"], out[key]["tps"] = stream_timing(vl.port, ids, GENERATED)
            loads = prefetches(lm.log_text())[mark:]
            out[key]["l2_chunks"] = sum(c for c, _ in loads[:1])
            out[key]["load_ms"] = sum(ms for _, ms in loads[:1])
            ref = reference[key]
            free = el.complete(vl.port, ids, max_tokens=GENERATED)["choices"][0]["token_ids"]
            out[key]["free_agree"] = sum(a == b for a, b in zip(free, ref["tokens"])) / GENERATED
            tf = el.teacher_forced(vl.port, ids, ref["tokens"])
            out[key]["tf_agree"] = sum(a == b for a, b in zip(tf["tokens"], ref["tf_tokens"])) / GENERATED
            out[key]["kld16"] = el.top_kld(ref["tf_top"][:KLD_POSITIONS], tf["top_logprobs"][:KLD_POSITIONS])
        loaded = el.lmcache_counts(lm)
    finally:
        vl.stop()
        lm.stop()
    return out, stored, loaded


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=2, help="prompts of each length (default 2)")
    ap.add_argument("--lengths", default="1024,2048,4096,8000", help="prompt lengths in tokens")
    ap.add_argument("--dataset-file", type=Path, default=DEFAULT_DATA)
    ap.add_argument("--only", default=None, help="comma-separated configuration tags to run (alone always runs)")
    ap.add_argument("--markdown", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None, help="also write every measurement (per prompt) as JSON")
    args = ap.parse_args(argv)
    from bench.report import Report

    from transformers import AutoTokenizer

    from kvcx.quality.engine_model import engine_checkpoint
    from kvcx.quality.models import load_dataset_text

    lengths = [int(x) for x in args.lengths.split(",")]
    ck = engine_checkpoint()
    tok = AutoTokenizer.from_pretrained(str(ck))
    text = load_dataset_text(args.dataset_file)
    ids = tok(text[TEXT_OFFSET:TEXT_OFFSET + 60 * max(lengths) * args.prompts])["input_ids"]
    prompts, at = {}, 0
    for n in lengths:
        for j in range(args.prompts):
            prompts[(n, j)] = ids[at:at + n]
            at += n
    if at > len(ids):
        raise SystemExit("bench_engine: the dataset is too short for these prompts")
    chosen = set(args.only.split(",")) if args.only else None
    work = Path(tempfile.mkdtemp(prefix="kvcx-bench-engine-"))
    rep = Report()
    t0 = time.time()
    try:
        results, counts = {}, {}
        cfgs = configs()
        reference = run_alone(ck, prompts, work)
        results["alone"] = reference
        for label, tag, serde in cfgs[1:]:
            if chosen and tag not in chosen:
                continue
            print(f"bench_engine: {label} ...", flush=True)
            results[tag], stored, loaded = run_lmcache(ck, prompts, serde, work, tag, reference)
            counts[tag] = (stored, loaded)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report(rep, cfgs, results, counts, lengths, args.prompts, time.time() - t0)
    if args.json:
        import json

        args.json.write_text(json.dumps({"lengths": lengths, "prompts": args.prompts, "counts": counts,
                                         "results": {t: {f"{k[0]}/{k[1]}": v for k, v in r.items()}
                                                     for t, r in results.items()}}, indent=1))
    if args.markdown:
        rep.write(args.markdown, "kvcx inside a real serving engine (vLLM's CPU build + LMCache's multiprocess "
                                 "server), against vLLM alone and LMCache's own serdes, on the same prompts.")


def _med(xs):
    return statistics.median(xs) if xs else float("nan")


def report(rep, cfgs, results, counts, lengths, n_prompts, wall):
    alone = results["alone"]
    raw = results.get("raw")
    rep(f"Model: SmolLM2-135M-Instruct (embedded GGUF, converted to a BF16 checkpoint), vLLM {_version('vllm')} "
        f"(CPU build, eager, block size 128), LMCache {_version('lmcache')}; {n_prompts} held-out WikiText-2 "
        f"prompts of each length; FS store; medians over the prompts of a length. Wall time {wall / 60:.1f} min.")
    rep("")
    rep("## Time to first token and decode speed")
    rep("")
    rep("Cold: the prompt computed (and, with LMCache, stored). From the store: both servers restarted, the prompt "
        "answered from the store. Ratios of the time from the store: vs vLLM alone's cold prefill of the same "
        "prompts (prefix cache off), vs the same configuration's own cold time (vLLM with LMCache's connector, "
        "prefix cache on), and vs LMCache's default serde from the store.")
    rep("")
    rep("| configuration | tokens | TTFT cold (s) | TTFT from store (s) | vs vLLM alone's prefill | vs its own cold | "
        "vs default serde | decode tokens/s |")
    rep("|---|---:|---:|---:|---:|---:|---:|---:|")
    for label, tag, _ in cfgs:
        if tag not in results:
            continue
        r = results[tag]
        for n in lengths:
            ks = [k for k in r if k[0] == n]
            cold = _med([r[k]["ttft_cold"] for k in ks])
            tps = _med([r[k]["tps"] for k in ks])
            if tag == "alone":
                rep(f"| {label} | {n:,} | {cold:.3f} | - | - | - | - | {tps:.1f} |")
                continue
            st = _med([r[k]["ttft_store"] for k in ks])
            base = _med([alone[k]["ttft_cold"] for k in ks])
            vs_raw = f"{st / _med([raw[k]['ttft_store'] for k in ks]):.2f}x" if raw else "-"
            rep(f"| {label} | {n:,} | {cold:.3f} | {st:.3f} | {st / base:.3f}x | {st / cold:.3f}x | {vs_raw} | "
                f"{tps:.1f} |")
    rep("")
    rep("## Bytes stored and the store's load speed")
    rep("")
    rep("Bytes a token: the FS files of a prompt's full chunks over their tokens. Load: LMCache's prefetch of a "
        "prompt's chunks from the FS store into L1 (file reads and the serde's decode), GB/s of BF16 KV "
        f"({30 * 2 * 3 * 64 * 2:,} B a token).")
    rep("")
    rep("| configuration | bytes / token | vs default serde | vs fp8 | load, median ms a chunk | load GB/s | "
        "failed stores | failed loads |")
    rep("|---|---:|---:|---:|---:|---:|---:|---:|")
    bpt = {}
    for label, tag, _ in cfgs[1:]:
        if tag not in results:
            continue
        r = results[tag]
        bpt[tag] = _med([v["bytes_per_token"] for v in r.values()])
    for label, tag, _ in cfgs[1:]:
        if tag not in results:
            continue
        r = results[tag]
        per_chunk = [v["load_ms"] / v["l2_chunks"] for v in r.values() if v["l2_chunks"]]
        gbs = [v["l2_chunks"] * CHUNK * 23040 / (v["load_ms"] * 1e6) for v in r.values() if v["l2_chunks"]]
        stored, loaded = counts[tag]
        rep(f"| {label} | {bpt[tag]:,.0f} | {_ratio(bpt, tag, 'raw')} | {_ratio(bpt, tag, 'fp8')} | "
            f"{_med(per_chunk):.1f} | {_med(gbs):.2f} | {stored['failed_stores'] + loaded['failed_stores']} | "
            f"{loaded['failed_loads']} |")
    rep("")
    rep("## Quality of the reloaded cache against vLLM alone")
    rep("")
    rep(f"The reference: vLLM alone's greedy continuation of each prompt ({GENERATED} tokens). Teacher-forced "
        "agreement: the share of its positions at which the configuration, given the prompt and the continuation "
        "before the position (one request a position, the prompt answered from the store), chooses the token vLLM "
        "alone chooses in the same requests (prefix cache on). Free-running: the share of positions at which the "
        "configuration's own greedy continuation holds the reference's token (two continuations part at their "
        f"first difference and rarely meet again). KLD: KL divergence of the configuration's top-5 next-token "
        f"logprobs from vLLM alone's over the first {KLD_POSITIONS} teacher-forced positions, mean, nats. The "
        "default serde's row is what an exact reload gives through the same path.")
    rep("")
    rep("| configuration | tokens | teacher-forced agreement | free-running agreement | KLD (first 16) |")
    rep("|---|---:|---:|---:|---:|")
    for label, tag, _ in cfgs[1:]:
        if tag not in results:
            continue
        r = results[tag]
        for n in lengths + [None]:
            ks = [k for k in r if n is None or k[0] == n]
            tf = statistics.mean(r[k]["tf_agree"] for k in ks)
            fr = statistics.mean(r[k]["free_agree"] for k in ks)
            kl = statistics.mean(r[k]["kld16"] for k in ks)
            rep(f"| {label} | {'all' if n is None else f'{n:,}'} | {tf:.3f} | {fr:.3f} | {kl:.4f} |")


def _ratio(bpt, tag, base):
    return f"{bpt[tag] / bpt[base]:.3f}x" if base in bpt else "-"


def _version(name):
    from importlib.metadata import PackageNotFoundError, version

    for n in (name, f"{name}-cpu"):
        try:
            return version(n)
        except PackageNotFoundError:
            continue
    return "?"


if __name__ == "__main__":
    main()
