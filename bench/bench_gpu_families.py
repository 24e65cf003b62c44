"""StaticKvcxCache on 2026's hybrid families on a CUDA GPU: decode steps replayed from CUDA graphs beside
transformers' StaticCache replayed the same way (issue 64's GPU half; issue 67, item 5).

    python -m bench.bench_gpu_families --markdown docs/results/gpu-families.md   # a CUDA machine, a few minutes
    python -m bench.bench_gpu_families --smoke                                 # tiny shapes, Triton's interpreter

Each family's attention at its released model's shapes (query and KV heads, head dims, window, sinks, MLA widths),
``--layers`` layers in its layer pattern (windowed to full as the model mixes them), small MLPs and experts (the
attention is what the caches differ in), random weights, BF16, batch 1:

- Gemma 3 (4B's attention): 8 query / 4 KV heads of 256, sliding windows of 1,024 tokens, 5 sliding : 1 full;
- GPT-OSS (20B's): 64 / 8 heads of 64, windows of 128 with per-head sinks, sliding and full alternating;
- Llama 4 (Scout's): 40 / 8 heads of 128, chunks of 8,192 tokens, 3 chunked : 1 full;
- DeepSeek V3 (MLA): 128 heads, latent 512 + RoPE key 64 (keys 128 + 64, values 128 a head), every layer MLA.

Per family and ``--prompts`` length: the prompt prefilled, then greedy steps, each a whole step (the model, the
argmax, the position's increment) replayed from a CUDA graph (bench_gpu's section 3, :func:`bench.bench_gpu.graph_rates`):
tokens/s from Python and from the graph for each cache, the ratio of the graphs', the bytes each cache holds for the
same capacity and their ratio. A cache that fails is a "failed" cell (its traceback on stderr); out of memory says so.
Without CUDA the kernels run in Triton's interpreter (``--smoke``: tiny shapes): figures from it say only that every
path runs.
"""
from __future__ import annotations

import argparse
import time

from bench.bench_gpu import FAILED, measure, static_kvcx_rates, static_rates
from bench.gpu_common import setup_device


def family_configs(smoke: bool, longest: int) -> dict:
    """name -> the family's config: its released model's attention shapes (tiny ones with ``smoke``)."""
    import transformers as T

    pos = dict(max_position_embeddings=2 * longest + 256, vocab_size=256 if smoke else 32768, pad_token_id=0,
               bos_token_id=1, eos_token_id=None)
    # DeepSeek V3's and GPT-OSS's configs default to YaRN scaled for their longest contexts: plain RoPE here (the
    # caches hold what the rotation gives either way)
    plain = dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    if smoke:
        s = dict(hidden_size=64, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
        return {
            "Gemma 3": T.Gemma3TextConfig(**pos, **s, num_hidden_layers=2, sliding_window=64,
                                          layer_types=["sliding_attention", "full_attention"]),
            "GPT-OSS": T.GptOssConfig(**pos, **s, num_hidden_layers=2, sliding_window=64, num_local_experts=2,
                                      num_experts_per_tok=1, layer_types=["sliding_attention", "full_attention"],
                                      **plain),
            "Llama 4 (chunked)": T.Llama4TextConfig(**pos, **s, num_hidden_layers=2, attention_chunk_size=64,
                                                    num_local_experts=2, intermediate_size_mlp=64,
                                                    layer_types=["chunked_attention", "full_attention"],
                                                    no_rope_layers=[1, 0]),
            "DeepSeek V3 (MLA)": T.DeepseekV3Config(**pos, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                                    num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None,
                                                    kv_lora_rank=64, qk_rope_head_dim=32, qk_nope_head_dim=32,
                                                    v_head_dim=32, first_k_dense_replace=2, n_routed_experts=2,
                                                    num_experts_per_tok=1, n_group=1, topk_group=1, **plain),
        }
    return {
        "Gemma 3 (4B's attention: sliding 1,024, 5:1)": T.Gemma3TextConfig(
            **pos, hidden_size=2560, intermediate_size=2560, num_hidden_layers=6, num_attention_heads=8,
            num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256, sliding_window=1024,
            layer_types=["sliding_attention"] * 5 + ["full_attention"]),
        "GPT-OSS (20B's attention: sliding 128 with sinks, 1:1)": T.GptOssConfig(
            **pos, hidden_size=2880, intermediate_size=2880, num_hidden_layers=6, num_attention_heads=64,
            num_key_value_heads=8, head_dim=64, sliding_window=128, num_local_experts=4, num_experts_per_tok=2,
            layer_types=["sliding_attention", "full_attention"] * 3, **plain),
        "Llama 4 (Scout's attention: chunked 8,192, 3:1)": T.Llama4TextConfig(
            **pos, hidden_size=5120, intermediate_size=2048, intermediate_size_mlp=2048, num_hidden_layers=4,
            num_attention_heads=40, num_key_value_heads=8, head_dim=128, attention_chunk_size=8192,
            num_local_experts=2, layer_types=["chunked_attention"] * 3 + ["full_attention"],
            no_rope_layers=[1, 1, 1, 0]),
        "DeepSeek V3 (MLA: latent 512 + 64, 128 heads)": T.DeepseekV3Config(
            **pos, hidden_size=7168, intermediate_size=2048, num_hidden_layers=4, num_attention_heads=128,
            num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
            v_head_dim=128, first_k_dense_replace=4, n_routed_experts=2, num_experts_per_tok=1, n_group=1,
            topk_group=1, **plain),
    }


def build(torch, dev, cfg):
    """The family's model on ``dev`` (BF16 on CUDA, FP32 elsewhere), seeded random weights, attention "kvcx"."""
    from transformers import AutoModelForCausalLM

    from kvcx.cache import kvcx_cache  # noqa: F401  (registers the "kvcx" attention implementation)

    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(dev):
            model = AutoModelForCausalLM.from_config(cfg, attn_implementation="kvcx")
    finally:
        torch.set_default_dtype(default)
    return model.eval()


def row(torch, dev, name: str, model, n: int, new_tokens: int, chunk: int) -> str:
    """One family's row at a prompt of ``n`` random tokens (batch 1)."""
    ids = torch.randint(3, model.config.vocab_size, (1, n), device=dev)
    st = measure(torch, dev, f"{name}, StaticCache at {n:,} tokens",
                 lambda: static_rates(torch, dev, model, ids, new_tokens, chunk))
    sk = measure(torch, dev, f"{name}, StaticKvcxCache at {n:,} tokens",
                 lambda: static_kvcx_rates(torch, dev, model, ids, new_tokens, chunk))

    def cell(r, i, f="{:.1f}", scale=1.0):
        if r is None:
            return "out of memory"
        if r == FAILED:
            return FAILED
        return "n/a" if r[i] is None else f.format(r[i] * scale)

    def ratio(i):
        ok = isinstance(st, tuple) and isinstance(sk, tuple) and st[i] and sk[i]
        return f"{sk[i] / st[i]:.2f}x" if ok else "n/a"

    mib = 2 ** -20
    return (f"| {name} | {n:,} | {cell(st, 0)} | {cell(sk, 0)} | {cell(st, 1)} | {cell(sk, 1)} | {ratio(1)} | "
            f"{cell(st, 2, '{:.1f}', mib)} | {cell(sk, 2, '{:.1f}', mib)} | {ratio(2)} | {cell(st, 3, '{:.0f}')} | "
            f"{cell(sk, 3, '{:.0f}')} |")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes: every path runs (any device, the interpreter)")
    ap.add_argument("--prompts", type=int, nargs="+", default=None, help="prompt lengths (default 4096 32768)")
    ap.add_argument("--new", type=int, default=None, help="greedy steps timed (default 32; smoke 3)")
    ap.add_argument("--families", nargs="*", default=None, help="the families to run (default all), by name prefix")
    ap.add_argument("--markdown", default=None, help="also write the table to this file")
    args = ap.parse_args(argv)
    prompts = args.prompts if args.prompts is not None else [160] if args.smoke else [4096, 32768]
    new = args.new if args.new is not None else 3 if args.smoke else 32
    if not prompts or min(prompts) < 1 or new < 1:
        ap.error(f"--prompts {prompts} / --new {new}: lengths and steps of 1 or more")
    torch, dev = setup_device(args.smoke)
    from bench.report import Report

    configs = family_configs(args.smoke, max(prompts))
    chosen = [n for n in configs if args.families is None or any(n.startswith(f) for f in args.families)]
    if not chosen:
        ap.error(f"--families {args.families}: none of {list(configs)} starts with those")
    out = Report()
    device = torch.cuda.get_device_name(0) if dev.type == "cuda" else "no GPU: Triton's interpreter on the CPU"
    out(f"Device: {device}; torch {torch.__version__}; triton {__import__('triton').__version__}")
    out("")
    out("| family | prompt | StaticCache tok/s | StaticKvcxCache tok/s | StaticCache graph tok/s | "
        "StaticKvcxCache graph tok/s | kvcx graph vs Static graph | StaticCache MiB | StaticKvcxCache MiB | "
        "StaticKvcxCache / StaticCache | StaticCache kernels a step | StaticKvcxCache kernels a step |")
    out("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    t0 = time.perf_counter()
    chunk = 64 if args.smoke else 4096
    for name in chosen:
        model = build(torch, dev, configs[name])
        for n in prompts:
            out(row(torch, dev, name, model, n, new, chunk))
        del model
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    out("")
    out(f"Total {time.perf_counter() - t0:.0f} s.")
    if args.markdown:
        out.write(args.markdown, "# StaticKvcxCache on the hybrid families, steps replayed from CUDA graphs\n\n"
                  "bench/bench_gpu_families.py: each family's attention at its released model's shapes, a few layers "
                  "in its layer pattern, random weights, BF16, batch 1; greedy steps replayed from a CUDA graph "
                  f"({new} timed), StaticCache and StaticKvcxCache for the same capacity (the prompt and the steps).")


if __name__ == "__main__":
    main()
