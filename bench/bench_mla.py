"""MLA decode steps with KvcxCache: the latent attended with kv_b_proj absorbed against transformers' expansion.

    python -m bench.bench_mla [--contexts 1024 4096 8192] [--heads 16] [--steps 8] [--markdown docs/results/mla.md]

A DeepSeek-V3-shaped attention (transformers' DeepseekV3Config: latent rank 512, RoPE key 64, per-head keys 128 + 64
and values 128, as DeepSeek V3 and Kimi K2 have them; ``--heads`` query heads of V3's 128: both sides' step cost
scales with them), 2 layers, hidden size 1024, seeded random weights, FP32, batch 1. Per context length, each cache
prefills the same random prompt, then decodes ``--steps`` tokens teacher-forced on DynamicCache's greedy tokens:

- DynamicCache (the model's SDPA attention): transformers caches the latent and, every step, expands the whole
  context into per-head keys and values (``kv_b_proj`` over every token) before attending;
- KvcxCache, ``fused=False``: the packed latent decoded, then the same expansion (what every KvcxCache MLA step did
  before the absorbed path);
- KvcxCache (the ``"kvcx"`` attention): the packed latent decoded, attended with ``kv_b_proj`` absorbed into the
  query and the output (kvcx/cache/latent.py): the context never expanded.

Columns: the median decode step (ms) and its ratio to DynamicCache's in the same run, the top-1 agreement with
DynamicCache over the steps, the bytes each cache holds after the steps (KvcxCache: packed and residual;
DynamicCache: its layers' tensors) and KvcxCache's scratch (the decoded latent of the layer being stepped, one
buffer all layers share: of 2 layers here, of 61 in DeepSeek V3). Threads: torch's, ``--threads`` (kvcx's kernels
the same).
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from bench.report import Report

RANK, ROPE, NOPE, V = 512, 64, 128, 128   # DeepSeek V3's MLA widths


def mla_config(heads: int, context: int):
    import transformers as T

    return T.DeepseekV3Config(vocab_size=256, hidden_size=1024, intermediate_size=256, num_hidden_layers=2,
                              num_attention_heads=heads, num_key_value_heads=heads, q_lora_rank=None,
                              kv_lora_rank=RANK, qk_rope_head_dim=ROPE, qk_nope_head_dim=NOPE, v_head_dim=V,
                              first_k_dense_replace=2, n_routed_experts=2, num_experts_per_tok=1, n_group=1,
                              topk_group=1, moe_intermediate_size=64, max_position_embeddings=2 * context,
                              pad_token_id=0, bos_token_id=1, eos_token_id=None)


def run_cache(model, make, attn: str, ids, forced):
    """(median step seconds, top-1 tokens [steps], the cache) of ``make()`` after prefilling ``ids``, teacher-forced
    on ``forced``."""
    import torch

    model.set_attn_implementation(attn)
    cache = make()
    times, tops = [], []
    with torch.no_grad():
        out = model(input_ids=ids, past_key_values=cache, use_cache=True)
        for tok in forced:
            tops.append(int(out.logits[0, -1].argmax()))
            t = time.perf_counter()
            out = model(input_ids=tok.view(1, 1), past_key_values=cache, use_cache=True)
            times.append(time.perf_counter() - t)
    return statistics.median(times), tops, cache


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 8192], help="prompt lengths in tokens")
    ap.add_argument("--heads", type=int, default=16, help="query heads (DeepSeek V3: 128)")
    ap.add_argument("--steps", type=int, default=8, help="decode steps timed after each prompt")
    ap.add_argument("--threads", type=int, default=None, help="torch's and kvcx's threads (default: torch's)")
    ap.add_argument("--markdown", type=Path, default=None, help="also write the table to this file")
    args = ap.parse_args(argv)
    bad_threads = args.threads is not None and args.threads < 1
    if min(args.contexts) < 128 or args.heads < 1 or args.steps < 1 or bad_threads:
        ap.error(f"--contexts {args.contexts} / --heads {args.heads} / --steps {args.steps} / --threads "
                 f"{args.threads}: contexts of 128 tokens or more (the packed latent needs whole groups), 1 head or "
                 "more, 1 step or more, 1 thread or more")
    import torch
    from transformers import AutoModelForCausalLM, DynamicCache

    from kvcx.cache import KvcxCache
    from kvcx.cache.kvcx_cache import dynamic_cache_bytes

    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    out = Report()
    out("| context | cache | decode step (ms) | vs DynamicCache | top-1 = DynamicCache's | cache bytes | "
        "vs DynamicCache | scratch bytes |")
    out("|---:|---|---:|---:|---:|---:|---:|---:|")
    for n in args.contexts:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(mla_config(args.heads, n + args.steps + 1),
                                                 attn_implementation="sdpa").eval()
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(3, 256, (1, n), generator=g)
        # DynamicCache's greedy tokens, fed to every cache
        model.set_attn_implementation("sdpa")
        with torch.no_grad():
            greedy = model.generate(ids, past_key_values=DynamicCache(config=model.config), max_new_tokens=args.steps,
                                    do_sample=False)[0, n:]
        rows = [("DynamicCache (SDPA; transformers expands the latent every step)",
                 lambda: DynamicCache(config=model.config), "sdpa"),
                ("KvcxCache fused=False (decoded, then expanded)",
                 lambda: KvcxCache(model.config, fused=False, n_threads=threads), "kvcx"),
                ("KvcxCache (decoded, kv_b_proj absorbed)", lambda: KvcxCache(model.config, n_threads=threads),
                 "kvcx")]
        results = [(label, *run_cache(model, make, attn, ids, greedy)) for label, make, attn in rows]
        base_t, base_top, base_cache = results[0][1:]
        base_bytes = dynamic_cache_bytes(base_cache)
        for label, t, tops, cache in results:
            if isinstance(cache, DynamicCache):
                held, scratch = dynamic_cache_bytes(cache), 0
            else:
                rep = cache.memory_report()
                held, scratch = rep["packed_bytes"] + rep["residual_bytes"], rep["scratch_bytes"]
            same = sum(a == b for a, b in zip(tops, base_top))
            out(f"| {n:,} | {label} | {1e3 * t:.1f} | {base_t / t:.2f}x | {same} / {len(tops)} | {held:,} "
                f"| {held / base_bytes:.3f}x | {scratch:,} |")
            if label.startswith("KvcxCache (") and isinstance(cache, KvcxCache):
                steps = [r["steps"] for r in cache.memory_report()["layers"]]
                print(f"  {n}: layer steps {steps}", flush=True)
        del model
    if args.markdown:
        out.write(args.markdown, "# MLA decode: the latent attended with kv_b_proj absorbed\n\n"
                  f"A DeepSeek-V3-shaped attention (latent rank {RANK}, RoPE key {ROPE}, keys {NOPE} + {ROPE} and "
                  f"values {V} a head; {args.heads} query heads of V3's 128: both sides' step cost scales with them), "
                  "2 layers, hidden size 1024, seeded random weights, FP32, batch 1 (bench/bench_mla.py). Each cache "
                  "prefills the same random prompt, then decodes "
                  f"{args.steps} tokens teacher-forced on DynamicCache's greedy tokens; the step is the median. "
                  "DynamicCache with the model's SDPA attention: transformers expands the cached latent into every "
                  "head's keys and values each step (kv_b_proj over the whole context). KvcxCache fused=False: its "
                  "packed latent decoded, then the same expansion (what its MLA steps did before the absorbed "
                  "path). KvcxCache with the 'kvcx' attention: the decoded latent attended with kv_b_proj absorbed "
                  "into the query and the output (kvcx/cache/latent.py), the context never expanded. Bytes after "
                  "the steps, FP32: the cache (KvcxCache: packed and residual; DynamicCache: its layers' tensors) "
                  "and KvcxCache's scratch (the decoded latent of the layer being stepped: one buffer the layers "
                  "share, of 2 layers here, of 61 in DeepSeek V3). The top-1 column: a random model's near-ties "
                  f"(quality is measured on the embedded model). Threads: {threads} for torch and kvcx.")


if __name__ == "__main__":
    main()
