"""KvcxCache in generation on the embedded SmolLM2-135M: agreement, memory held, decode speed, peak RSS.

    python -m bench.bench_generate [--prompt 4000] [--steps 64] [--contexts 16 512 4096 8000]

Caches compared in one run, on the same text: DynamicCache (FP32, SDPA), KvcxCache with the fused
attention kernel (the model's attention set to "kvcx"), KvcxCache materialising (fused=False: packed
chunks decoded into an FP32 scratch, then SDPA) and, when optimum-quanto is installed, transformers'
QuantizedCache (quanto, int4, groups of 64, residual 128). `--presets kvcx3 kvcx2 kvcx2w` adds a row per
preset: fused where the kernel reads the preset's codes, else materialising (labelled so):

    python -m bench.bench_generate --presets kvcx3 kvcx2 kvcx2w --contexts 512 8000 --skip rss --no-quanto \
        --markdown docs/results/generate-presets.md

1. Agreement: after a WikiText-2 prompt of --prompt tokens the next --steps tokens are fed one at a
   time (teacher-forced); top-1 predictions are compared with DynamicCache's, and the fused path's
   logits with the materialising path's (max |difference|). Greedy generation from the same prompt
   reports the first diverging position (not a gate). Bytes held: every array the cache keeps alive.
2. Decode speed after a context of each length, each cache against DynamicCache in a fresh process of
   its own (the two alone: in a process that also holds the other caches DynamicCache's step is slower,
   which overstated the ratios; see docs/RESULTS.md): the context is prefilled once (DynamicCache) and
   copied into both, then the two decode in interleaved rounds (median step). Per step: tokens/s and
   ratio vs that process's DynamicCache, the attention part (all layers: the attention functions timed
   apart, SDPA for DynamicCache), the bytes the attention reads, and the kvcx kernel share. Bounds: the step
   outside attention (the model's own work) and the ratio vs DynamicCache a cache would reach with its
   attention free, or costing only the time to read its bytes at the read bandwidth the process measures.
3. A multi-token step (a long prompt's next chunk, or a batch of draft tokens to verify): after a
   --chunk-prefix-token context (prefilled once, copied into every cache: packed in KvcxCache), one
   --chunk-token step, --chunk-reps times per cache interleaved (median): step time, the attention part
   (all layers) vs SDPA over DynamicCache, the layer steps per path and the full-precision scratch the
   cache holds after it (the materialising path decodes the whole context into it; the fused path none).
4. Peak RSS of an 8,000-token prefill and of the decode steps after it, each cache in a fresh process
   (VmHWM after a reset): DynamicCache, KvcxCache, and KvcxCache with release_heap=False (the C heap's
   free pages kept: what the prefill's temporaries leave resident without kvcx handing them back).
Threads: torch and kvcx both on torch.get_num_threads() (printed).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared/data/wikitext-2-raw/wiki.test.raw"
QUANTO = "QuantizedCache (quanto int4 g64)"
FOR_MODEL = "KvcxCache.for_model fused"   # the default scheme, guarded by the induction probe
ATTN_TIME = {"s": 0.0}
# the RSS section's fresh processes: kind -> row label
RSS_KINDS = {"dynamic": "DynamicCache", "kvcx": "KvcxCache fused",
             "kvcx-heap-kept": "KvcxCache fused, release_heap=False"}


def timed_attention():
    """Wrap kvcx's attention function (SDPA for every cache but KvcxCache's fused steps, which run the
    kernel) so that its time adds up in ATTN_TIME (bench only)."""
    from transformers.modeling_utils import AttentionInterface

    from kvcx.cache import attention_fn

    def wrap(fn):
        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                ATTN_TIME["s"] += time.perf_counter() - t
        return timed

    AttentionInterface.register(attention_fn.ATTN_IMPLEMENTATION, wrap(attention_fn.kvcx_attention_forward))


def model_and_ids(dataset_file, n, timed=True):
    """The embedded model with kvcx's attention (timed apart when `timed`), the first n tokens of the text."""
    import torch

    from kvcx.quality.models import load_dataset_text, load_model_and_tokenizer

    model, tok, name = load_model_and_tokenizer(cpu=True)
    if timed:
        timed_attention()
    model.set_attn_implementation("kvcx")  # SDPA for everything but KvcxCache's fused steps
    ids = torch.tensor(tok(load_dataset_text(dataset_file)[: n * 12])["input_ids"][:n])[None]
    return model, ids, name


def make_caches(model, with_quanto=True, presets=(), for_model=False):
    from transformers import DynamicCache

    from kvcx.cache import fused
    from kvcx.cache.kvcx_cache import KvcxCache
    from kvcx.codecs import KVConfig

    caches = {"DynamicCache": DynamicCache,
              "KvcxCache fused": lambda: KvcxCache(model.config, fused=True),
              "KvcxCache materialising": lambda: KvcxCache(model.config, fused=False)}
    for p in presets:   # fused where the kernel reads the preset's codes, else as the cache decides
        kv = KVConfig.from_scheme(p)
        why = fused.fused_unsupported(kv.key, kv.value, model.config.head_dim,
                                      model.config.num_attention_heads // model.config.num_key_value_heads)
        label = f"KvcxCache fused {p}" if why is None else f"KvcxCache materialising {p}"
        caches[label] = (lambda p=p, why=why: KvcxCache(model.config, scheme=p, fused=True if why is None else None))
    if for_model:   # the default scheme with the induction probe's guard (8-bit keys in a tenth of the layers)
        caches[FOR_MODEL] = lambda: KvcxCache.for_model(model, fused=True)
    if with_quanto:
        try:
            import optimum.quanto  # noqa: F401
            from transformers import QuantizedCache

            caches[QUANTO] = lambda: QuantizedCache("quanto", model.config, nbits=4, q_group_size=64,
                                                    residual_length=128)
        except ImportError:
            print("optimum-quanto not installed: pip install optimum-quanto to compare with it", file=sys.stderr)
    return caches


def cache_bytes(cache):
    from kvcx.cache.kvcx_cache import KvcxCache, dynamic_cache_bytes

    if isinstance(cache, KvcxCache):
        return cache.memory_report()["total_bytes"]
    if type(cache).__name__ == "DynamicCache":
        return dynamic_cache_bytes(cache)
    return None


def teacher_forced(model, ids, prompt, steps, cache):
    import torch

    logits = []
    with torch.inference_mode():
        out = model(ids[:, :prompt], past_key_values=cache, use_cache=True)
        logits.append(out.logits[0, -1].clone())
        for j in range(prompt, prompt + steps - 1):
            logits.append(model(ids[:, j:j + 1], past_key_values=cache, use_cache=True).logits[0, -1].clone())
    return torch.stack(logits)


def greedy(model, ids, prompt, steps, cache):
    import torch

    with torch.inference_mode():
        g = model.generate(ids[:, :prompt], past_key_values=cache, max_new_tokens=steps, do_sample=False,
                           min_new_tokens=steps)
    return g[0, prompt:].tolist()


def copy_cache(src, mk):
    """A new cache of kind mk holding src's context (what the model's layers do during a prefill)."""
    from kvcx.quality.bridge import cache_layers

    cache = mk()
    for i, (k, v) in enumerate(cache_layers(src)):
        cache.update(k.clone(), v.clone(), i)
    return cache


def read_bytes(label, cache, layers, kv_heads, head_dim, tokens):
    """Bytes the attention reads in one decode step (all layers)."""
    fp32 = 2 * layers * kv_heads * tokens * head_dim * 4
    if label == "DynamicCache":
        return fp32
    if label.startswith("KvcxCache"):
        rep = cache.memory_report()
        held = rep["packed_bytes"] + rep["residual_bytes"]
        return held if "fused" in label else held + 2 * fp32  # decode writes the FP32 scratch, SDPA reads it
    return None


def decode_rounds(model, caches, start_tok, rounds, per_round):
    """Interleaved rounds: each cache decodes per_round steps in turn; per-step times, attention and kernel."""
    import torch

    stats = {k: {"step": [], "attn": 0.0, "kernel": 0.0, "n": 0} for k in caches}
    tok = {k: start_tok for k in caches}
    with torch.inference_mode():
        for _ in range(rounds):
            for label, cache in caches.items():
                for _ in range(per_round):
                    a0, k0 = ATTN_TIME["s"], getattr(cache, "kernel_time_s", 0.0)
                    t = time.perf_counter()
                    tok[label] = model(tok[label], past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
                    s = stats[label]
                    s["step"].append(time.perf_counter() - t)
                    s["attn"] += ATTN_TIME["s"] - a0
                    s["kernel"] += getattr(cache, "kernel_time_s", 0.0) - k0
                    s["n"] += 1
    return stats


def speed_child(label, context, args):
    """In a fresh process: DynamicCache and the cache `label` alone, after `context` tokens (prefilled once
    with DynamicCache, copied into the other), decode in interleaved rounds; print their figures as JSON."""
    import numpy as np
    import torch
    from transformers import DynamicCache

    model, ids, _ = model_and_ids(args.dataset_file, context + 1)
    ids = ids[:, :context]
    cfg = model.config
    caches = make_caches(model, label == QUANTO, args.presets, args.for_model)
    if label not in caches or label == "DynamicCache":
        others = ", ".join(c for c in caches if c != "DynamicCache")
        raise SystemExit(f"bench_generate: --speed-child: no cache {label!r} to compare (with --presets "
                         f"{' '.join(args.presets) or '(none)'}: {others})")
    mk = caches[label]
    base = DynamicCache()
    with torch.inference_mode():
        out = model(ids, past_key_values=base, use_cache=True)
    start = out.logits[:, -1:].argmax(-1)
    del out
    live = {"DynamicCache": copy_cache(base, DynamicCache), label: copy_cache(base, mk)}
    del base
    stats = decode_rounds(model, live, start, args.rounds, args.per_round)
    res = {"read_bw": read_bandwidth()}
    for name, s in stats.items():
        rb = read_bytes(name, live[name], cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim,
                        context + args.rounds * args.per_round // 2)
        steps = None
        if name.startswith("KvcxCache") and name != "KvcxCache materialising":
            steps = live[name].memory_report()["attention_steps"]
        res[name] = {"step": float(np.median(s["step"])), "attn": s["attn"] / s["n"], "rb": rb,
                     "share": s["kernel"] / sum(s["step"]), "steps": steps}
    print(json.dumps(res))


def read_bandwidth(nbytes=256 * 2**20, reps=5):
    """Bytes/s this process reads from memory: the best of `reps` torch sums over an FP32 array of `nbytes`
    (far past the caches), on torch's threads (as the step's). What the attention's reads cost at the least."""
    import torch

    x = torch.ones(nbytes // 4)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return nbytes / best


def run_child(*argv):
    """This script run again in a fresh process with ``argv``: (the JSON object of its last such line, None) or
    (None, the last line of its stderr) when it failed."""
    r = subprocess.run([sys.executable, __file__, *argv], capture_output=True, text=True,
                       env={**os.environ, "TQDM_DISABLE": "1"})
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode or not line:
        return None, r.stderr.strip().splitlines()[-1:]
    return json.loads(line[-1]), None


def rss_child(kind, context, steps, dataset_file):
    """In a fresh process: prefill `context` tokens into one cache, then decode; print the RSS figures."""
    import gc

    import torch
    from transformers import DynamicCache

    from kvcx.cache.kvcx_cache import KvcxCache
    def status(field):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
        return None

    model, ids, _ = model_and_ids(dataset_file, context + 1, timed=False)
    cache = DynamicCache() if kind == "dynamic" else KvcxCache(model.config, fused=True,
                                                               release_heap=kind != "kvcx-heap-kept")
    gc.collect()
    loaded = status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    with torch.inference_mode():
        t0 = time.perf_counter()
        out = model(ids[:, :context], past_key_values=cache, use_cache=True)
        prefill_s = time.perf_counter() - t0
        prefill_peak = status("VmHWM")
        t = out.logits[:, -1:].argmax(-1)
        del out
        gc.collect()
        t = model(t, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)  # first step outside
        gc.collect()
        before = status("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
        for _ in range(steps):
            t = model(t, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
    peak = status("VmHWM")
    held = cache_bytes(cache)
    print(json.dumps({"kind": kind, "loaded": loaded, "prefill_s": prefill_s, "prefill_peak": prefill_peak,
                      "rss_before": before, "peak": peak, "growth": peak - before, "held": held}))


def multi_token(model, ids, caches, args, emit):
    """Section 3: one step of args.chunk tokens after args.chunk_prefix tokens, every cache, interleaved reps."""
    import numpy as np
    import torch
    from transformers import DynamicCache

    P, C = args.chunk_prefix, args.chunk
    emit(f"\n## A {C}-token step after {P:,} tokens (a prompt's next chunk, or drafts to verify): "
         f"{args.chunk_reps} interleaved reps per cache, median\n")
    emit("| cache | step ms | vs DynamicCache | attention ms (all layers) | attention vs SDPA | layer steps "
         "(fused / materialised) | full-precision scratch held after the step |")
    emit("|---|---:|---:|---:|---:|---:|---:|")
    base = DynamicCache()
    with torch.inference_mode():
        model(ids[:, :P], past_key_values=base, use_cache=True)
    chunk = ids[:, P:P + C]
    times = {k: {"step": [], "attn": []} for k in caches}
    last = {}
    for _ in range(args.chunk_reps):
        for label, mk in caches.items():
            cache = copy_cache(base, mk)
            a0 = ATTN_TIME["s"]
            t = time.perf_counter()
            with torch.inference_mode():
                model(chunk, past_key_values=cache, use_cache=True)
            times[label]["step"].append(time.perf_counter() - t)
            times[label]["attn"].append(ATTN_TIME["s"] - a0)
            last[label] = cache
    dyn = {k: float(np.median(v)) for k, v in times["DynamicCache"].items()}
    for label in caches:
        step, attn = (float(np.median(times[label][k])) for k in ("step", "attn"))
        cache = last[label]
        paths, scratch = "", ""
        if label.startswith("KvcxCache"):
            rep = cache.memory_report()
            st = rep["attention_steps"]
            paths = f"{st['fused']} / {st['materialised']}"
            scratch = f"{rep['scratch_bytes'] / 2**20:.2f} MiB"
        emit(f"| {label} | {1000 * step:.0f} | {dyn['step'] / step:.2f}x | {1000 * attn:.0f} | "
             f"{dyn['attn'] / attn:.2f}x | {paths} | {scratch} |", flush=True)
    emit("\n(scratch: the materialising path's decoded context plus the step's attention mask; DynamicCache holds "
         "its whole context in FP32 by design)")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt", type=int, default=4000)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--contexts", type=int, nargs="+", default=[16, 512, 4096, 8000])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--per-round", type=int, default=4)
    ap.add_argument("--rss-context", type=int, default=8000)
    ap.add_argument("--dataset-file", type=Path, default=DEFAULT_DATA)  # the Makefile passes it explicitly
    ap.add_argument("--no-quanto", action="store_true")
    ap.add_argument("--presets", nargs="*", default=[], help="KvcxCache presets to add (kvcx3 kvcx2 kvcx2w ...)")
    ap.add_argument("--for-model", action="store_true", help="add KvcxCache.for_model(model): the default scheme with "
                                                             "the induction probe's guard (the probe runs per cache)")
    ap.add_argument("--chunk", type=int, default=128, help="tokens of the multi-token step")
    ap.add_argument("--chunk-prefix", type=int, default=8000, help="context before the multi-token step")
    ap.add_argument("--chunk-reps", type=int, default=5)
    ap.add_argument("--skip", nargs="*", default=[], choices=["agreement", "speed", "chunk", "rss"])
    ap.add_argument("--rss-child", nargs=2, metavar=("KIND", "STEPS"), help=argparse.SUPPRESS)
    ap.add_argument("--speed-child", nargs=2, metavar=("LABEL", "CONTEXT"), help=argparse.SUPPRESS)
    ap.add_argument("--markdown", type=Path, default=None, help="also write the tables to this file")
    args = ap.parse_args(argv)
    if args.rss_child:
        if args.rss_child[0] not in RSS_KINDS or not args.rss_child[1].isdigit():
            ap.error(f"--rss-child {' '.join(args.rss_child)}: KIND is one of {', '.join(RSS_KINDS)}, STEPS a count")
        return rss_child(args.rss_child[0], args.rss_context, int(args.rss_child[1]), args.dataset_file)
    from kvcx.codecs import KVConfig
    from kvcx.errors import KvcxError

    for p in args.presets:   # a clear error before the model loads
        try:
            KVConfig.from_scheme(p)
        except KvcxError as e:
            ap.error(f"--presets {p}: {e}")
    if args.speed_child:
        ctx = args.speed_child[1]
        if not ctx.isdigit() or int(ctx) < 1:
            ap.error(f"--speed-child: the context must be a positive number of tokens, got {ctx!r}")
        return speed_child(args.speed_child[0], int(ctx), args)

    import torch
    from bench.report import Report

    emit = Report()

    need = max(args.prompt + args.steps, max(args.contexts) + 1, args.chunk_prefix + args.chunk)
    model, ids, name = model_and_ids(args.dataset_file, need)
    cfg = model.config
    L, Hkv, D = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim
    emit(f"# {name}: {L} layers, {Hkv} KV heads of {D}, {cfg.num_attention_heads} query heads; FP32 on CPU; "
          f"torch threads {torch.get_num_threads()}, kvcx threads {torch.get_num_threads()}")
    caches = make_caches(model, not args.no_quanto, args.presets, args.for_model)

    if "agreement" not in args.skip:
        emit(f"\n## Agreement: {args.prompt}-token prompt, next {args.steps} tokens teacher-forced\n")
        emit("| cache | top-1 agreement with DynamicCache | greedy: first divergence | bytes held (everything) "
              "| vs FP16 DynamicCache |")
        emit("|---|---:|---:|---:|---:|")
        ref = ref_greedy = None
        logits = {}
        fp16 = None
        for label, mk in caches.items():
            cache = mk()
            lg = teacher_forced(model, ids, args.prompt, args.steps, cache)
            logits[label] = lg
            held = cache_bytes(cache)
            if label == "DynamicCache":
                fp16 = held // 2  # the CPU cache is FP32
            g = greedy(model, ids, args.prompt, args.steps, mk())
            if ref is None:
                ref, ref_greedy = lg.argmax(-1), g
            agree = int((lg.argmax(-1) == ref).sum())
            div = next((i for i, (a, b) in enumerate(zip(ref_greedy, g)) if a != b), None)
            held_s = f"{held:,}" if held is not None else "n/a"
            ratio = f"{held / fp16:.3f}x" if held is not None and fp16 else "n/a"
            emit(f"| {label} | {agree / len(ref):.1%} ({agree}/{len(ref)}) | {'none' if div is None else div} | "
                  f"{held_s} | {ratio} |", flush=True)
        if "KvcxCache fused" in logits and "KvcxCache materialising" in logits:
            d = (logits["KvcxCache fused"] - logits["KvcxCache materialising"]).abs().max().item()
            m = logits["KvcxCache materialising"].abs().max().item()
            emit(f"\nfused vs materialising logits over the {args.steps} steps: max |difference| {d:.2e} "
                  f"(max |logit| {m:.1f})")

    if "speed" not in args.skip:
        emit(f"\n## Decode speed: each cache with DynamicCache in a fresh process of their own, {args.rounds} "
             f"interleaved rounds of {args.per_round} greedy steps each (median step)\n")
        emit("| context | cache | tok/s | vs DynamicCache | step ms | DynamicCache step ms (same process) "
             "| attention ms / step (all layers) | attention vs SDPA | attention reads / step | "
             "DynamicCache reads / step | kvcx kernel share | step outside attention ms | bound: attention free | "
             "bound: attention at the read bandwidth |")
        emit("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        versus = []   # the presets' attention per step against the first preset's (a speed target's form)
        for ctx in args.contexts:
            paths, attn = [], {}
            for label in (lb for lb in caches if lb != "DynamicCache"):
                res, err = run_child("--speed-child", label, str(ctx), "--rounds", str(args.rounds), "--per-round",
                                     str(args.per_round), "--dataset-file", str(args.dataset_file),
                                     "--presets", *args.presets, *(["--for-model"] if args.for_model else []))
                if res is None:
                    emit(f"| {ctx} | {label} | failed: {err} |||||||||||")
                    continue
                d, k = res["DynamicCache"], res[label]
                mb = (lambda b: f"{b / 1e6:.1f} MB" if b is not None else "n/a")
                share = f"{k['share']:.0%}" if label.startswith("KvcxCache") else ""
                # the ratio vs DynamicCache this cache would reach with its attention free, or reading its bytes
                # at the machine's read bandwidth: the model's own work outside attention stays
                outside = k["step"] - k["attn"]
                at_bw = f"{d['step'] / (outside + k['rb'] / res['read_bw']):.2f}x" if k["rb"] else "n/a"
                emit(f"| {ctx} | {label} | {1 / k['step']:.2f} | {d['step'] / k['step']:.2f}x | "
                     f"{1000 * k['step']:.1f} | {1000 * d['step']:.1f} | {1000 * k['attn']:.2f} | "
                     f"{d['attn'] / k['attn']:.2f}x | {mb(k['rb'])} | {mb(d['rb'])} | {share} | "
                     f"{1000 * outside:.1f} | {d['step'] / outside:.2f}x | {at_bw} |", flush=True)
                attn[label] = k["attn"]
                if k["steps"] is not None:
                    st = k["steps"]
                    paths.append(f"{label}: layer steps fused {st['fused']}, materialised {st['materialised']}, "
                                 f"full precision {st['full_precision']}")
            for p in paths:
                emit(f"|  | ({p}) ||||||||||||| ")
            first = next((lb for lb in attn if lb.endswith(f" {args.presets[0]}")), None) if args.presets else None
            versus += [f"{lb.rsplit(' ', 1)[-1]} {attn[lb] / attn[first]:.2f}x ({1000 * attn[lb]:.2f} / "
                       f"{1000 * attn[first]:.2f} ms at {ctx:,})" for lb in attn
                       if first and lb != first and lb.endswith(tuple(f" {p}" for p in args.presets[1:]))]
        if versus:
            emit(f"\nAttention per step (all layers) against the first preset, {args.presets[0]}, each in its own "
                 f"process: {'; '.join(versus)}.")
        emit("\nBounds: the ratio vs DynamicCache a cache would reach if its attention took no time (the step minus "
             "its attention: the model's own work stays), and if its attention took only the time to read its bytes "
             "once at the read bandwidth measured in the same process (the best of 5 sums over 256 MiB, torch's "
             "threads).")

    if "chunk" not in args.skip:
        multi_token(model, ids, caches, args, emit)

    if "rss" not in args.skip:
        emit(f"\n## Peak RSS while prefilling {args.rss_context:,} tokens, then decoding 32 steps (fresh process "
              "each)\n")
        emit("RSS with the model loaded, the prefill's time and peak RSS, RSS after it (and a first step), peak while "
             "decoding; KvcxCache with and without `release_heap` (default on: the C heap's free pages handed back "
             "after each layer packs the prompt).\n")
        emit("| cache | RSS loaded | prefill | peak during prefill | RSS before decode | peak during decode | growth | "
             "bytes held |")
        emit("|---|---:|---:|---:|---:|---:|---:|---:|")
        for kind, label in RSS_KINDS.items():
            d, err = run_child("--rss-child", kind, "32", "--rss-context", str(args.rss_context), "--dataset-file",
                               str(args.dataset_file))
            if d is None:
                emit(f"| {label} | failed: {err} |||||||")
                continue
            mib = {k: f"{d[k] / 2**20:.0f} MiB" for k in ("loaded", "prefill_peak", "rss_before", "peak")}
            emit(f"| {label} | {mib['loaded']} | {d['prefill_s']:.1f} s | {mib['prefill_peak']} | "
                  f"{mib['rss_before']} | {mib['peak']} | {d['growth'] / 2**20:.1f} MiB | "
                  f"{d['held'] / 2**20:.1f} MiB |", flush=True)

    if args.markdown:
        parts = [p for p, skip in (("agreement with DynamicCache", "agreement"),
                                   ("decode speed after contexts of " + ", ".join(f"{c:,}" for c in args.contexts)
                                    + " tokens", "speed"),
                                   (f"a {args.chunk}-token step after {args.chunk_prefix:,} tokens", "chunk"),
                                   ("peak RSS", "rss")) if skip not in args.skip]
        presets = f" (presets: {', '.join(args.presets)})" if args.presets else ""
        presets += " (and KvcxCache.for_model: the default scheme, guarded by the induction probe)" if args.for_model \
            else ""
        emit.write(args.markdown, f"KvcxCache decoding the embedded model (FP32 on CPU){presets}: "
                                  f"{', '.join(parts)}.")

if __name__ == "__main__":
    main()
