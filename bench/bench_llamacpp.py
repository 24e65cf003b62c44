"""The llama.cpp emulations against llama.cpp itself: the same model (the embedded GGUF), the same windows and
token ids, llama.cpp's own KV cache types (`type_k` / `type_v`, flash attention) through llama-cpp-python,
beside kvcx's engine-mode emulation of the same types (`kvcx validate --mode engine --scheme ...`).

    pip install llama-cpp-python        # builds llama.cpp from source (~20 min on 2 cores)
    python -m bench.bench_llamacpp --max-windows 8 --markdown docs/results/llamacpp.md

In llama.cpp a window runs as one batch whose keys and values are written into the quantized cache before
attention reads them: kvcx's engine mode does the same with the emulated codec. Each side is measured against
its own exact run (llama.cpp: an F16 cache; kvcx: the model's FP32 cache), on the last `stride` tokens of
each window: perplexity delta, mean KL divergence of the next-token distributions, top-1 agreement.
"""
from __future__ import annotations

import argparse
import math
import os
import time
from pathlib import Path

import numpy as np

DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared/data/wikitext-2-raw/wiki.test.raw"
TYPES = "q8_0,q4_0,iq4_nl"


def log_softmax(z):
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def compare(base_logits, comp_logits, targets):
    """(base NLL sum, comp NLL sum, KL sum, top-1 matches) over rows, float64."""
    lp, lq = log_softmax(base_logits.astype(np.float64)), log_softmax(comp_logits.astype(np.float64))
    rows = np.arange(len(targets))
    kl = np.clip((np.exp(lp) * (lp - lq)).sum(-1), 0, None).sum()
    return (-lp[rows, targets].sum(), -lq[rows, targets].sum(), kl,
            int((base_logits.argmax(-1) == comp_logits.argmax(-1)).sum()))


def llama_logits(llama_cpp, path, windows, n_ctx, type_kv, ctx_len, threads):
    """Logits of the scored rows of every window, from llama.cpp with the given KV cache type."""
    kw = dict(model_path=path, n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, logits_all=True, n_threads=threads,
              verbose=False, flash_attn=True)
    if type_kv is not None:
        code = getattr(llama_cpp, f"GGML_TYPE_{type_kv.upper()}")
        kw.update(type_k=code, type_v=code)
    llm = llama_cpp.Llama(**kw)
    out = []
    for win in windows:
        llm.reset()
        llm.eval(list(map(int, win)))
        out.append(np.array(llm.scores[ctx_len:len(win) - 1], dtype=np.float32))
    del llm
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", default=TYPES, help="llama.cpp KV cache types, comma-separated")
    ap.add_argument("--max-windows", type=int, default=8)
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--stride", type=int, default=512)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--dataset-file", type=Path, default=DEFAULT_DATA)
    ap.add_argument("--markdown", type=Path, default=None)
    args = ap.parse_args(argv)
    import llama_cpp
    import torch
    from bench.report import Report

    from kvcx.api import validation_settings
    from kvcx.quality.models import embedded_model_path, load_model_and_tokenizer
    from kvcx.quality.scoring import window_starts
    from kvcx.quality.validation import run_validations

    types = [t.strip() for t in args.types.split(",") if t.strip()]
    loaded = load_model_and_tokenizer(None, cpu=True)
    _, tok, name = loaded
    ids = tok(args.dataset_file.read_text(encoding="utf-8"), return_tensors=None)["input_ids"]
    starts = window_starts(len(ids), args.window, args.stride, args.max_windows)
    windows = [np.asarray(ids[a:a + args.window]) for a in starts]
    ctx_len = args.window - args.stride
    path = embedded_model_path()
    os.environ.pop("LLAMA_ATTN_ROT_DISABLE", None)
    t = time.perf_counter()
    base = llama_logits(llama_cpp, path, windows, args.window, None, ctx_len, args.threads)
    n = sum(len(w) - ctx_len - 1 for w in windows)
    rows = {}
    for ty in types:
        for rotated in (True, False):    # llama.cpp reads LLAMA_ATTN_ROT_DISABLE when it builds its cache
            if rotated:
                os.environ.pop("LLAMA_ATTN_ROT_DISABLE", None)
            else:
                os.environ["LLAMA_ATTN_ROT_DISABLE"] = "1"
            comp = llama_logits(llama_cpp, path, windows, args.window, ty, ctx_len, args.threads)
            sums = np.zeros(4)
            for b, c, w in zip(base, comp, windows):
                sums += compare(b, c, w[ctx_len + 1:])
            rows[ty, rotated] = (math.exp(sums[0] / n), math.exp(sums[1] / n), sums[2] / n, sums[3] / n)
    os.environ.pop("LLAMA_ATTN_ROT_DISABLE", None)
    t_llama = time.perf_counter() - t
    settings = ",".join(types + [f"{ty}-rot" for ty in types])
    configs, _ = validation_settings(settings)
    torch.set_num_threads(args.threads)
    t = time.perf_counter()
    emu = {r.setting: r for r in run_validations(configs, window=args.window, stride=args.stride,
                                                 max_windows=args.max_windows, dataset_file=args.dataset_file,
                                                 mode="engine", loaded=loaded)}
    t_emu = time.perf_counter() - t
    out = Report()
    r0 = next(iter(emu.values()))
    out(f"Embedded {name}; WikiText-2 raw test, {len(windows)} windows of {args.window} (stride {args.stride}), "
        f"{n:,} tokens scored, the same token ids on both sides. llama.cpp: llama-cpp-python "
        f"{llama_cpp.__version__} (its vendored llama.cpp has the attention rotation), CPU, flash attention, one "
        f"batch per window; its baseline an F16 cache (perplexity {rows[types[0], True][0]:.4f}). kvcx: engine "
        f"mode on the FP32 model; its baseline the FP32 cache (perplexity {r0.baseline_perplexity:.4f}). Each "
        f"side against its own baseline: perplexity delta, mean KLD (nats/token), top-1 agreement.")
    out("")
    out("| KV type | rotation | llama.cpp delta | llama.cpp KLD | llama.cpp top-1 | kvcx delta | kvcx KLD | "
        "kvcx top-1 |")
    out("|---|---|---:|---:|---:|---:|---:|---:|")
    for ty in types:
        for rotated in (True, False):
            b, c, kl, top = rows[ty, rotated]
            e = emu[f"{ty}-rot" if rotated else ty]
            out(f"| `{ty}` | {'on (default)' if rotated else 'off (LLAMA_ATTN_ROT_DISABLE=1)'} | {c - b:+.4f} | "
                f"{kl:.5f} | {100 * top:.2f}% | {e.delta:+.4f} | {e.kld:.5f} | {100 * e.top1_agreement:.2f}% |")
    out("")
    out(f"Wall time: llama.cpp {t_llama:.0f} s ({2 * len(types) + 1} runs), kvcx emulation {t_emu:.0f} s "
        f"({2 * len(types)} settings).")
    if args.markdown:
        out.write(args.markdown, "llama.cpp's KV cache types run by llama.cpp itself beside kvcx's emulation of "
                                 "them, on the same windows and token ids.")


if __name__ == "__main__":
    main()
