"""Retrieval at long contexts with statistics (`kvcx validate --task ruler` / `--task passkey`): every setting
against the exact cache on the same generated prompts, per task and length the prompts answered with a 95 %
Wilson interval and McNemar's exact one-sided test (Holm-adjusted over a setting's cells).

    python -m bench.bench_retrieval --tasks passkey --lengths 8192 --depths 0.9 --prompts 20 \
        --scheme kvcx,q8_0 --markdown docs/results/retrieval-passkey-8k.md

Settings: any `kvcx validate --scheme` list, presses included (`kvcx+snapkv:0.5`), and plan files (`--plans`). Also printed: where the time
went (the exact prefills, each setting's eviction and codec round trips, the greedy answers).
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
    ap.add_argument("--tasks", default="passkey", help="tasks, comma-separated, or ruler (all but passkey)")
    ap.add_argument("--lengths", default="4096,8192", help="context lengths, comma-separated")
    ap.add_argument("--depths", default="0.1,0.3,0.5,0.7,0.9", help="needle depths, comma-separated")
    ap.add_argument("--prompts", type=int, default=20, help="prompts per task, length and depth")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dataset-file", type=Path, default=None)
    ap.add_argument("--markdown", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None, help="also write every result as JSON")
    args = ap.parse_args(argv)
    from bench.report import Report

    from kvcx.api import load_plan, validation_settings
    from kvcx.quality import ruler
    from kvcx.quality.models import load_model_and_tokenizer
    from kvcx.quality.peers import PEERS
    from kvcx.quality.retrieval import run_retrieval

    configs, _ = validation_settings(args.scheme, peers=PEERS)
    for p in filter(None, args.plans.split(",")):
        name = Path(p).name
        configs[name[:-len(".json")] if name.endswith(".json") else name] = load_plan(p)
    tasks = ["passkey"] if args.tasks == "passkey" else ruler.task_names(args.tasks)
    loaded = load_model_and_tokenizer(None, cpu=True)
    t = time.perf_counter()
    results = run_retrieval(configs, tasks, lengths=[int(x) for x in args.lengths.split(",")],
                            depths=[float(x) for x in args.depths.split(",")], prompts=args.prompts, seed=args.seed,
                            dataset_file=args.dataset_file, loaded=loaded,
                            task_label="passkey" if tasks == ["passkey"] else "ruler",
                            on_prompt=lambda d, n: print(f"prompt {d}/{n}, {time.perf_counter() - t:.0f} s",
                                                         flush=True))
    wall = time.perf_counter() - t
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20
    r0 = results[0]
    out = Report()
    out(f"Embedded {r0.model}; tasks {', '.join(tasks)}; {r0.prompts} prompts per task, length and depth (depths "
        f"{', '.join(f'{100 * d:g}' for d in r0.depths)} % of the context), seed {r0.seed}; prefix mode. A cell: "
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
    secs = r0.seconds
    out(f"Wall time {wall:.0f} s; peak RSS {rss:.2f} GiB. Where it went: exact prefills {secs['prefill']:.0f} s, "
        f"exact answers {secs['exact_answers']:.0f} s; per setting, eviction and codec round trips / answers: " +
        "; ".join(f"`{r.setting}` {r.seconds['roundtrip']:.0f} / {r.seconds['answers']:.0f} s" for r in results) + ".")
    if args.json:
        args.json.write_text(json.dumps([r.to_dict() for r in results], indent=1) + "\n")
    if args.markdown:
        out.write(args.markdown, "Retrieval at long contexts on the embedded model, with statistics: every setting "
                                 "against the exact cache on the same prompts.")


if __name__ == "__main__":
    main()
