"""Retrieval at long contexts (`kvcx validate --task passkey`): a five-digit key hidden at depths of 10-90 % of
contexts from 1,024 tokens to the model's limit, asked for with the exact cache and with each setting's
compressed cache, on the same prompts.

    python -m bench.bench_passkey --prompts 2 --markdown docs/results/passkey.md

Settings (default): those of bench_engines.py (kvcx's default, KIVI, llama.cpp's types with and without its
rotation, vLLM's fp8). Per length: prompts answered by the exact cache and by each setting (of depths x
prompts); per depth for the longest context; wall time and peak RSS of the run.
"""
from __future__ import annotations

import argparse
import resource
import time
from pathlib import Path

from bench.bench_engines import SETTINGS


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scheme", default=SETTINGS, help="settings, comma-separated (any `kvcx validate --scheme`)")
    ap.add_argument("--lengths", default=None, help="context lengths, comma-separated (default: 1024 doubling "
                                                     "up to the model's context)")
    ap.add_argument("--prompts", type=int, default=2, help="prompts per length and depth")
    ap.add_argument("--tolerance", type=int, default=1)
    ap.add_argument("--markdown", type=Path, default=None)
    args = ap.parse_args(argv)
    from bench.report import Report

    from kvcx.api import validation_settings
    from kvcx.quality.models import load_model_and_tokenizer
    from kvcx.quality.passkey import run_passkey

    configs, _ = validation_settings(args.scheme)
    loaded = load_model_and_tokenizer(None, cpu=True)
    lengths = [int(x) for x in args.lengths.split(",")] if args.lengths else None
    t = time.perf_counter()
    results = run_passkey(configs, lengths=lengths, prompts=args.prompts, tolerance=args.tolerance, loaded=loaded,
                          on_prompt=lambda d, n: print(f"prompt {d}/{n}, {time.perf_counter() - t:.0f} s", flush=True))
    wall = time.perf_counter() - t
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20
    r0 = results[0]
    n = r0.prompts * len(r0.depths)
    out = Report()
    out(f"Embedded {r0.model}; {r0.prompts} prompts per length and depth (depths "
        f"{', '.join(f'{100 * d:g}' for d in r0.depths)} % of the context), {n} per length, seed {r0.seed}; "
        f"prefix mode (each prompt's context cache compressed once, the question and the greedy answer attend to "
        f"it); a setting passes when it answers at most {r0.tolerance} prompt(s) fewer than the exact cache at "
        f"every length.")
    out("")
    out("| context (tokens) | exact cache | " + " | ".join(f"`{r.setting}` ({r.bits_per_value:.2f} b/v)"
                                                           for r in results) + " |")
    out("|---:|---:|" + "---:|" * len(results))
    for i, (length, exact, _, _) in enumerate(r0.per_length()):
        out(f"| {length:,} | {exact}/{n} | " + " | ".join(f"{r.per_length()[i][2]}/{n}" for r in results) + " |")
    out("| verdict | | " + " | ".join("PASS" if r.passed else "FAIL" for r in results) + " |")
    out("")
    longest = r0.lengths[-1]
    out(f"At {longest:,} tokens, answered per depth (of {r0.prompts}):")
    out("")
    out("| depth | exact cache | " + " | ".join(f"`{r.setting}`" for r in results) + " |")
    out("|---:|---:|" + "---:|" * len(results))
    for j, d in enumerate(r0.depths):
        out(f"| {100 * d:g} % | {r0.exact[-1][j]} | " + " | ".join(str(r.compressed[-1][j]) for r in results) + " |")
    out("")
    out(f"Wall time {wall:.0f} s for {len(r0.lengths) * n} prompts x (1 exact + {len(results)} compressed) answers; "
        f"peak RSS {rss:.2f} GiB.")
    if args.markdown:
        out.write(args.markdown, "Passkey retrieval at long contexts on the embedded model: prompts answered with the "
                                 "exact cache and with each compressed cache, the same prompts for all.")


if __name__ == "__main__":
    main()
