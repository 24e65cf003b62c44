"""KvcxCache in generation on the embedded SmolLM2-135M: token agreement, memory and speed.

    python bench/bench_generate.py [--prompt 4000] [--steps 64] [--contexts 512 4096]

1. Token agreement: after a WikiText-2 prompt of --prompt tokens, the next --steps tokens of the
   text are fed one at a time (teacher-forced) through DynamicCache, KvcxCache (defaults) and,
   when optimum-quanto is installed, transformers' QuantizedCache (quanto, int4, groups of 64,
   residual 128); the top-1 predictions are compared with DynamicCache's. Greedy generation from
   the same prompt is also run and the first diverging position reported (not a gate).
2. Memory: bytes held by each cache after the prompt and the steps.
3. Speed: decode tokens/s with DynamicCache vs KvcxCache after a context of each length, and the
   time spent in kvcx kernels (all in this run, on this machine).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared/data/wikitext-2-raw/wiki.test.raw"


def make_caches(model, with_quanto=True):
    from transformers import DynamicCache

    from kvcx.hf import KvcxCache

    caches = {"DynamicCache": lambda: DynamicCache(), "KvcxCache": lambda: KvcxCache(model.config)}
    if with_quanto:
        try:
            import optimum.quanto  # noqa: F401
            from transformers import QuantizedCache

            caches["QuantizedCache (quanto int4 g64)"] = lambda: QuantizedCache(
                "quanto", model.config, nbits=4, q_group_size=64, residual_length=128)
        except ImportError:
            print("optimum-quanto not installed: pip install optimum-quanto to compare with it", file=sys.stderr)
    return caches


def cache_bytes(cache):
    from kvcx.hf import KvcxCache, dynamic_cache_bytes

    if isinstance(cache, KvcxCache):
        return cache.memory_report()["total_bytes"]
    if type(cache).__name__ == "DynamicCache":
        return dynamic_cache_bytes(cache)
    return None


def teacher_forced(model, ids, prompt, steps, cache):
    import torch

    with torch.inference_mode():
        out = model(ids[:, :prompt], past_key_values=cache, use_cache=True)
        preds = [int(out.logits[0, -1].argmax())]
        for j in range(prompt, prompt + steps - 1):
            out = model(ids[:, j:j + 1], past_key_values=cache, use_cache=True)
            preds.append(int(out.logits[0, -1].argmax()))
    return preds


def greedy(model, ids, prompt, steps, cache):
    import torch

    with torch.inference_mode():
        g = model.generate(ids[:, :prompt], past_key_values=cache, max_new_tokens=steps, do_sample=False,
                           min_new_tokens=steps)
    return g[0, prompt:].tolist()


def decode_speed(model, ids, context, steps, cache):
    import torch

    with torch.inference_mode():
        out = model(ids[:, :context], past_key_values=cache, use_cache=True)
        tok = out.logits[:, -1:].argmax(-1)
        k0 = getattr(cache, "kernel_time_s", 0.0)
        t = time.perf_counter()
        for _ in range(steps):
            tok = model(tok, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        dt = time.perf_counter() - t
    return steps / dt, getattr(cache, "kernel_time_s", 0.0) - k0, dt


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt", type=int, default=4000)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 4096])
    ap.add_argument("--speed-steps", type=int, default=32)
    ap.add_argument("--dataset-file", type=Path, default=DEFAULT_DATA)  # the Makefile passes it explicitly
    ap.add_argument("--no-quanto", action="store_true")
    args = ap.parse_args(argv)

    import torch

    from kvcx.models import load_dataset_text, load_model_and_tokenizer

    model, tok, name = load_model_and_tokenizer(cpu=True)
    text = load_dataset_text(args.dataset_file)
    need = max(args.prompt + args.steps, max(args.contexts) + 1)
    ids = torch.tensor(tok(text[: need * 12])["input_ids"][:need])[None]
    print(f"# {name}, torch threads {torch.get_num_threads()}")

    caches = make_caches(model, not args.no_quanto)
    print(f"\n## Token agreement: {args.prompt}-token prompt, next {args.steps} tokens teacher-forced\n")
    print("| cache | top-1 agreement with DynamicCache | greedy: first divergence | bytes held | vs FP16 |")
    print("|---|---:|---:|---:|---:|")
    ref_tf = ref_greedy = None
    fp16 = None
    for label, mk in caches.items():
        cache = mk()
        tf = teacher_forced(model, ids, args.prompt, args.steps, cache)
        held = cache_bytes(cache)
        if label == "DynamicCache":
            fp16 = held // 2  # the CPU cache is FP32
        g = greedy(model, ids, args.prompt, args.steps, mk())
        if ref_tf is None:
            ref_tf, ref_greedy = tf, g
        agree = sum(a == b for a, b in zip(ref_tf, tf)) / len(ref_tf)
        div = next((i for i, (a, b) in enumerate(zip(ref_greedy, g)) if a != b), None)
        held_s = f"{held:,}" if held is not None else "n/a"
        ratio = f"{held / fp16:.3f}x" if held is not None and fp16 else "n/a"
        print(f"| {label} | {agree:.1%} ({sum(a == b for a, b in zip(ref_tf, tf))}/{len(tf)}) | "
              f"{'none' if div is None else div} | {held_s} | {ratio} |", flush=True)

    print(f"\n## Decode speed ({args.speed_steps} greedy steps after the context)\n")
    quanto = [k for k in caches if k.startswith("QuantizedCache")]
    print("| context | DynamicCache tok/s | KvcxCache tok/s | ratio | kvcx kernel time / step |"
          + "".join(f" {q} tok/s | ratio |" for q in quanto))
    print("|---:|---:|---:|---:|---:|" + "---:|---:|" * len(quanto))
    for ctx in args.contexts:
        dyn, _, _ = decode_speed(model, ids, ctx, args.speed_steps, caches["DynamicCache"]())
        kv, kt, dt = decode_speed(model, ids, ctx, args.speed_steps, caches["KvcxCache"]())
        row = (f"| {ctx} | {dyn:.1f} | {kv:.1f} | {kv / dyn:.2f} | {1000 * kt / args.speed_steps:.1f} ms "
               f"({kt / dt:.0%}) |")
        for q in quanto:
            qs, _, _ = decode_speed(model, ids, ctx, args.speed_steps, caches[q]())
            row += f" {qs:.1f} | {qs / dyn:.2f} |"
        print(row, flush=True)


if __name__ == "__main__":
    main()
