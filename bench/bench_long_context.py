"""Long contexts, both axes of compression (issue 51's results): retrieval accuracy on the kept tasks and
perplexity/KLD at the same context length, for quantization alone, token eviction alone, both composed, and plans
that spend one budget on bits and keep ratios per layer (``kvcx calibrate --scheme kvcx3+snapkv:0.5``).

    python -m bench.bench_long_context --lengths 4096 --tasks passkey,niah_single --prompts 20 \
        --scheme exact-free settings... --plans plan-1.0.json --markdown docs/results/long-context-4k.md \
        --pareto docs/results/long-context-4k.png

Retrieval: `kvcx validate --task ruler` on the same prompts for every setting (McNemar against the exact cache,
Holm over a setting's cells). Perplexity: prefix mode, windows of the context length (the last ``--stride`` tokens
scored over the compressed rest), ``--ppl-windows`` of them, from the start of WikiText-2's test text (the needles'
haystack is held out past them). Bits per value-equivalent count every byte held per token of the full context
(kept codes, scales, zero points and positions), against 16-bit values.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def kind_of(setting) -> str:
    from kvcx.presses import PressedSetting

    if isinstance(setting, PressedSetting):
        if setting.press.layer_keep:
            return "calibrated"
        return "eviction" if setting.codec is None else "both"
    return "quantization"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scheme", default="kvcx,snapkv:0.5,kvcx+snapkv:0.5", help="settings (any validate --scheme)")
    ap.add_argument("--plans", default="", help="calibrated plan files, comma-separated (labelled by file name)")
    ap.add_argument("--tasks", default="passkey", help="retrieval tasks, comma-separated")
    ap.add_argument("--lengths", default="4096", help="context lengths, comma-separated")
    ap.add_argument("--depths", default="0.5", help="needle depths, comma-separated")
    ap.add_argument("--prompts", type=int, default=20, help="prompts per task, length and depth")
    ap.add_argument("--ppl-windows", type=int, default=4, help="perplexity windows per length (0: none)")
    ap.add_argument("--stride", type=int, default=512, help="tokens scored per perplexity window")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--query-aware", action="store_true", help="the question prefilled with the context: presses "
                                                               "see it (SnapKV's window)")
    ap.add_argument("--dataset-file", type=Path, default=None)
    ap.add_argument("--markdown", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--pareto", type=Path, default=None, help="PNG: accuracy vs bits per value-equivalent")
    args = ap.parse_args(argv)
    from bench.report import Report

    from kvcx.api import load_plan, validation_settings
    from kvcx.quality.models import load_model_and_tokenizer
    from kvcx.quality.peers import PEERS
    from kvcx.quality.retrieval import run_retrieval
    from kvcx.quality.ruler import task_names
    from kvcx.quality.validation import run_validations

    configs, _ = validation_settings(args.scheme, peers=PEERS)
    for p in filter(None, args.plans.split(",")):
        name = Path(p).name
        configs[name[:-len(".json")] if name.endswith(".json") else name] = load_plan(p)   # a shipped name keeps its dots
    tasks = ["passkey"] if args.tasks == "passkey" else task_names(args.tasks)
    lengths = [int(x) for x in args.lengths.split(",")]
    loaded = load_model_and_tokenizer(None, cpu=True)
    t0 = time.perf_counter()
    results = run_retrieval(configs, tasks, lengths=lengths, depths=[float(x) for x in args.depths.split(",")],
                            prompts=args.prompts, seed=args.seed, dataset_file=args.dataset_file, loaded=loaded,
                            task_label="ruler", query_aware=args.query_aware,
                            on_prompt=lambda d, n: print(f"prompt {d}/{n}, {time.perf_counter() - t0:.0f} s",
                                                         flush=True))
    t_retrieval = time.perf_counter() - t0
    ppl = {}
    for n in lengths if args.ppl_windows else []:
        t = time.perf_counter()
        ppl[n] = {r.setting: r for r in run_validations(configs, dataset_file=args.dataset_file, window=n,
                                                        stride=args.stride, max_windows=args.ppl_windows,
                                                        loaded=loaded, threshold=1e9)}
        print(f"perplexity at {n}: {time.perf_counter() - t:.0f} s", flush=True)
    wall = time.perf_counter() - t0
    r0 = results[0]
    kept = [c for c in r0.cells if c.kept]
    out = Report()
    out(f"Embedded {r0.model}; tasks {', '.join(tasks)} ({', '.join(r0.tasks) or 'none'} kept: the exact cache "
        f"answers at least half of their prompts at some length); {r0.prompts} prompts per task, length and depth "
        f"(depths {', '.join(f'{100 * d:g}' for d in r0.depths)} % of the context), seed {r0.seed}; prefix mode, "
        + ("query-aware (the question prefilled with the context: a press sees it). " if args.query_aware else
           "query-agnostic (the context compressed before the question is known). ") + "A "
        "cell: prompts answered with its 95 % Wilson interval; p: McNemar's exact one-sided test against the exact "
        f"cache on the same prompts, Holm-adjusted over the setting's cells (alpha {r0.alpha}). Perplexity and KLD: "
        f"{args.ppl_windows} windows of the context length, the last {args.stride} tokens scored. Bits per "
        "value-equivalent: every byte held (codes, scales, zero points, kept positions) per value of the full "
        "context; 16 = FP16.")
    out("")
    head = "| setting | kind | bits/value | " + " | ".join(f"{c.task} {c.length:,}" for c in kept) + " | verdict | " + \
        " | ".join(f"ppl delta {n:,} | KLD {n:,}" for n in ppl) + " |"
    out(head)
    out("|---|---|---:|" + "---:|" * len(kept) + "---|" + "---:|---:|" * len(ppl))
    exact_cells = " | ".join(f"{c.exact_correct}/{c.prompts}" for c in kept)
    out(f"| exact cache | exact | 16 | {exact_cells} | | " + " | ".join("0 | 0" for _ in ppl) + " |")
    points = [{"bits": 16.0, "accuracy": sum(c.exact_correct for c in kept) / max(1, sum(c.prompts for c in kept)),
               "label": "exact", "kind": "exact"}]
    for r in results:
        cells = [c for c in r.cells if c.kept]
        row = " | ".join(f"{c.correct}/{c.prompts} ({100 * c.ci_low:.0f}-{100 * c.ci_high:.0f} %), p={c.p_adjusted:.2g}"
                         for c in cells)
        figs = " | ".join(f"{ppl[n][r.setting].delta:+.3f} | {ppl[n][r.setting].kld:.4f}" for n in ppl)
        kind = kind_of(configs[r.setting])
        out(f"| `{r.setting}` | {kind} | {r.bits_per_value:.3f} | {row} | {'PASS' if r.passed else 'FAIL'} | {figs} |")
        points.append({"bits": r.bits_per_value, "accuracy": sum(c.correct for c in cells) / max(1, sum(
            c.prompts for c in cells)), "label": r.setting, "kind": kind})
    out("")
    for task, why in r0.dropped.items():
        out(f"Dropped {task}: {why}.")
    secs = r0.seconds
    out(f"Wall time {wall:.0f} s (retrieval {t_retrieval:.0f} s: exact prefills {secs['prefill']:.0f} s, exact "
        f"answers {secs['exact_answers']:.0f} s, every setting's round trips "
        f"{sum(r.seconds['roundtrip'] for r in results):.0f} s and answers {sum(r.seconds['answers'] for r in results):.0f}"
        f" s; perplexity {wall - t_retrieval:.0f} s).")
    if args.json:
        args.json.write_text(json.dumps({"retrieval": [r.to_dict() for r in results],
                                         "perplexity": {str(n): {k: v.to_dict() for k, v in d.items()}
                                                        for n, d in ppl.items()}}, indent=1) + "\n")
    if args.pareto:
        from kvcx.formats.atomic import OutputSet, write_bytes_to
        from kvcx.quality.plots import retrieval_pareto_png

        png = retrieval_pareto_png(points, title=f"{r0.model}: {', '.join(r0.tasks)} at "
                                                 f"{', '.join(f'{n:,}' for n in lengths)} tokens, {r0.prompts} prompts "
                                                 "a cell")
        with OutputSet([args.pareto]) as tmp:
            write_bytes_to(tmp[str(args.pareto)], str(args.pareto), [png])
        out(f"\n![accuracy against bits per value-equivalent]({args.pareto.name})")
    if args.markdown:
        out.write(args.markdown, "Long contexts, both axes of compression: retrieval and perplexity for quantization, "
                                 "token eviction, both, and calibrated bits x keep plans, on the same prompts and text.")


if __name__ == "__main__":
    main()
