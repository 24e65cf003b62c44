"""Retrieval at long contexts with statistics (`kvcx validate --task ruler` / `--task passkey`): every setting
against the exact cache on the same generated prompts, per task and length the prompts answered with a 95 %
Wilson interval and McNemar's exact one-sided test (Holm-adjusted over a setting's cells); per depth where there
are several. The one retrieval bench: the passkey grid, the deep needle, RULER's tasks and, with
``--ppl-windows``, both axes of compression at one context length (perplexity and KLD beside retrieval, a row a
setting, with its kind: quantization, eviction, both, calibrated; ``--pareto`` draws accuracy against bits).

    python -m bench.bench_retrieval --tasks passkey --lengths 8192 --depths 0.9 --prompts 20 \
        --scheme kvcx,q8_0 --markdown docs/results/retrieval-passkey-8k.md
    python -m bench.bench_retrieval --tasks passkey --lengths 1024,2048,4096,8192 --prompts 2 \
        --scheme kvcx,kivi,q8_0,q4_0 --markdown docs/results/passkey.md                 # the passkey grid
    python -m bench.bench_retrieval --lengths 4096 --tasks passkey,niah_single --depths 0.5 --ppl-windows 4 \
        --scheme kvcx,snapkv:0.5,kvcx+snapkv:0.5 --plans plan.json --pareto docs/results/long-context-4k.png

Settings: any `kvcx validate --scheme` list, presses included (`kvcx+snapkv:0.5`), and plan files (`--plans`).
Also printed: where the time went (the exact prefills, each setting's eviction and codec round trips, the greedy
answers, the perplexity windows). Bits per value-equivalent count every byte held per token of the full context
(kept codes, scales, zero points and positions), against 16-bit values.
"""
from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scheme", default="kvcx", help="settings, comma-separated (any `kvcx validate --scheme`)")
    ap.add_argument("--plans", default="", help="plan files, comma-separated (labelled by file name)")
    ap.add_argument("--keys-before-rope", default="", help="kvcx schemes also run with their keys coded before RoPE, "
                    "comma-separated (rows '<scheme>, keys before RoPE'; `kvcx validate --keys-before-rope`)")
    ap.add_argument("--tasks", default="passkey", help="tasks, comma-separated, or ruler (all but passkey)")
    ap.add_argument("--lengths", default="4096,8192", help="context lengths, comma-separated")
    ap.add_argument("--depths", default="0.1,0.3,0.5,0.7,0.9", help="needle depths, comma-separated")
    ap.add_argument("--prompts", type=int, default=20, help="prompts per task, length and depth")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--query-aware", action="store_true", help="the question prefilled with the context: presses "
                                                               "see it (SnapKV's window)")
    ap.add_argument("--ppl-windows", type=int, default=0,
                    help="also perplexity and KLD at each context length: windows a length (0, the default: none)")
    ap.add_argument("--stride", type=int, default=512, help="tokens scored per perplexity window")
    ap.add_argument("--dataset-file", type=Path, default=None)
    ap.add_argument("--markdown", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None, help="also write every result as JSON")
    ap.add_argument("--pareto", type=Path, default=None, help="PNG: accuracy on the kept cells vs bits per "
                                                              "value-equivalent")
    args = ap.parse_args(argv)
    if args.ppl_windows < 0 or args.stride < 1:
        ap.error("--ppl-windows is 0 (none) or more, --stride 1 or more")
    from bench.report import Report

    from kvcx.api import load_plan, validation_settings
    from kvcx.quality import ruler
    from kvcx.quality.models import load_model_and_tokenizer
    from kvcx.quality.peers import PEERS
    from kvcx.quality.retrieval import run_retrieval

    configs, _ = validation_settings(args.scheme, peers=PEERS)
    if args.keys_before_rope:
        turned, _ = validation_settings(args.keys_before_rope, keys_before_rope=True)
        configs.update({f"{label}, keys before RoPE": cfg for label, cfg in turned.items()})
    for p in filter(None, args.plans.split(",")):
        name = Path(p).name
        configs[name[:-len(".json")] if name.endswith(".json") else name] = load_plan(p)
    tasks = ["passkey"] if args.tasks == "passkey" else ruler.task_names(args.tasks)
    lengths = [int(x) for x in args.lengths.split(",")]
    loaded = load_model_and_tokenizer(None, cpu=True)
    t = time.perf_counter()
    results = run_retrieval(configs, tasks, lengths=lengths,
                            depths=[float(x) for x in args.depths.split(",")], prompts=args.prompts, seed=args.seed,
                            dataset_file=args.dataset_file, loaded=loaded, query_aware=args.query_aware,
                            task_label="passkey" if tasks == ["passkey"] else "ruler",
                            on_prompt=lambda d, n: print(f"prompt {d}/{n}, {time.perf_counter() - t:.0f} s",
                                                         flush=True))
    t_retrieval = time.perf_counter() - t
    ppl = perplexity(configs, lengths, args, loaded)
    wall = time.perf_counter() - t
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20
    r0 = results[0]
    out = Report()
    out(f"Embedded {r0.model}; tasks {', '.join(tasks)}; {r0.prompts} prompts per task, length and depth (depths "
        f"{', '.join(f'{100 * d:g}' for d in r0.depths)} % of the context), seed {r0.seed}; prefix mode, "
        + ("query-aware (the question prefilled with the context: a press sees it). " if args.query_aware else
           "query-agnostic (the context compressed before the question is known). ") + "A cell: "
        "prompts answered (every answer in the greedy reply) and its 95 % Wilson interval; the exact cache's on the "
        f"same prompts beside it. A setting fails where McNemar's exact one-sided test, Holm-adjusted over its "
        f"cells, puts it below the exact cache at alpha {r0.alpha}.")
    out("")
    out("| task | context | exact cache | " + " | ".join(f"`{r.setting}` ({r.bits_per_value:.2f} b/v)"
                                                        for r in results) + " |")
    out("|---|---:|---:|" + "---:|" * len(results))
    for i, c0 in enumerate(r0.cells):
        row = []
        for r in results:
            c = r.cells[i]
            row.append(f"{c.correct}/{c.prompts} ({100 * c.ci_low:.0f}-{100 * c.ci_high:.0f} %), p={c.p_adjusted:.2g}")
        task = c0.task + ("" if c0.kept else " (dropped)")
        out(f"| {task} | {c0.length:,} | {c0.exact_correct}/{c0.prompts} | " + " | ".join(row) + " |")
    out("| verdict | | | " + " | ".join(("PASS" if r.passed else "FAIL") + f" (p={r.p_value:.2g})" for r in results)
        + " |")
    out("")
    if len(r0.depths) > 1:
        out("Per depth (all lengths together): exact cache / each setting.")
        out("")
        out("| task | context | depth | exact | " + " | ".join(f"`{r.setting}`" for r in results) + " |")
        out("|---|---:|---:|---:|" + "---:|" * len(results))
        for i, c0 in enumerate(r0.cells):
            for j, d in enumerate(c0.by_depth):
                out(f"| {c0.task} | {c0.length:,} | {100 * d['depth']:g} % | {d['exact_correct']}/{d['prompts']} | "
                    + " | ".join(str(r.cells[i].by_depth[j]["correct"]) for r in results) + " |")
        out("")
    for task, why in r0.dropped.items():
        out(f"Dropped {task}: {why}.")
    points = both_axes(out, results, configs, ppl, args) if ppl or args.pareto else []
    secs = r0.seconds
    out(f"Wall time {wall:.0f} s; peak RSS {rss:.2f} GiB. Where it went: exact prefills {secs['prefill']:.0f} s, "
        f"exact answers {secs['exact_answers']:.0f} s; per setting, eviction and codec round trips / answers: " +
        "; ".join(f"`{r.setting}` {r.seconds['roundtrip']:.0f} / {r.seconds['answers']:.0f} s" for r in results) +
        (f"; perplexity {wall - t_retrieval:.0f} s" if ppl else "") + ".")
    if args.json:
        rows = [r.to_dict() for r in results]
        args.json.write_text(json.dumps({"retrieval": rows, "perplexity": {str(n): {k: v.to_dict() for k, v in
                                                                                    d.items()}
                                                                         for n, d in ppl.items()}}
                                        if ppl else rows, indent=1) + "\n")
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
        out.write(args.markdown, "Retrieval at long contexts on the embedded model, with statistics: every setting "
                                 "against the exact cache on the same prompts.")


def kind_of(setting) -> str:
    """quantization, eviction, both, or calibrated (a plan of bits and keep ratios per layer)."""
    from kvcx.presses import PressedSetting

    if isinstance(setting, PressedSetting):
        if setting.press.layer_keep:
            return "calibrated"
        return "eviction" if setting.codec is None else "both"
    return "quantization"


def perplexity(configs, lengths, args, loaded) -> dict:
    """{length: {setting: ValidationResult}}: prefix mode over ``--ppl-windows`` windows of each context length,
    the last ``--stride`` tokens scored (from the start of the dataset text; the needles' haystack is held out past
    them); {} without ``--ppl-windows``."""
    from kvcx.quality.validation import run_validations

    ppl = {}
    for n in lengths if args.ppl_windows else []:
        t = time.perf_counter()
        ppl[n] = {r.setting: r for r in run_validations(configs, dataset_file=args.dataset_file, window=n,
                                                        stride=args.stride, max_windows=args.ppl_windows,
                                                        loaded=loaded, threshold=1e9)}
        print(f"perplexity at {n}: {time.perf_counter() - t:.0f} s", flush=True)
    return ppl


def both_axes(out, results, configs, ppl: dict, args) -> list:
    """The table of both axes, a row a setting: its kind, bits per value-equivalent, its kept cells, verdict,
    perplexity delta and KLD at each length; returns the Pareto chart's points (accuracy over the kept cells)."""
    r0 = results[0]
    kept = [c for c in r0.cells if c.kept]
    out(f"Both axes of compression, a row a setting (kept cells; perplexity and KLD: {args.ppl_windows} windows of "
        f"the context length, the last {args.stride} tokens scored; bits per value-equivalent: every byte held per "
        "value of the full context, 16 = FP16).")
    out("")
    out("| setting | kind | bits/value | " + " | ".join(f"{c.task} {c.length:,}" for c in kept) + " | verdict | " +
        " | ".join(f"ppl delta {n:,} | KLD {n:,}" for n in ppl) + " |")
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
    return points


if __name__ == "__main__":
    main()
