"""Write the README's generated regions from measured files, never by hand.

    python -m bench.publish [--validate-log make_validate.log]

- ``headline``: the summary table of headline figures, read from the tables the bench scripts wrote into
  docs/results/ (quality.md, codec.md, generate.md, lmcache.md, engine.md), each row linking to its report;
- ``engines`` / ``engines-8k``: the tables of kvcx's settings and the engines' KV formats at windows of 1,024
  and of 8,192 from docs/results/engines.md (one run of bench_engines.py, a section per window size);
- ``passkey``: the retrieval table from docs/results/passkey.md;
- ``validate`` (with ``--validate-log``): the output of one ``make validate`` run, progress bars removed.

A region is the text between ``<!-- NAME:begin -->`` and ``<!-- NAME:end -->``: ``headline`` in README.md,
``validate`` in docs/getting-started.md, the others in docs/guide/cli.md.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"


def table(path: Path, title_prefix: str = "") -> dict:
    """The rows of the markdown tables in ``path`` (after the heading that starts with ``title_prefix``),
    keyed by their first cell (and the second, for tables whose first column repeats): {key: [cells]}."""
    rows, on = {}, not title_prefix
    for line in path.read_text().splitlines():
        if line.startswith("#"):
            on = not title_prefix or line.lstrip("# ").startswith(title_prefix)
        if not on or not line.startswith("|") or line.startswith("|---") or line.startswith("|---:"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        rows[cells[0]] = cells
        if len(cells) > 1:
            rows[(cells[0], cells[1])] = cells
    return rows


def find(rows: dict, start: str) -> list:
    for k, v in rows.items():
        if isinstance(k, str) and k.startswith(start):
            return v
    raise SystemExit(f"publish: no row starting with {start!r}; run the bench that writes it")


def headline() -> str:
    q = table(RESULTS / "quality.md")
    codec = table(RESULTS / "codec.md")
    gen = table(RESULTS / "generate.md")
    lmc = table(RESULTS / "lmcache.md")

    def quality(start):
        r = find(q, start)   # setting, bits, ratio, RMSE, SNR, ppl, delta, KLD, top-1, ms
        return f"{r[6]} perplexity at {r[1]} bits/value ({r[2]} vs FP16), KLD {float(r[7]):.4f}, top-1 {r[8]}"

    ref = find(codec, "reference")
    fused8k = gen[("8000", "KvcxCache fused")]   # context, cache, tok/s, vs DynamicCache, step, its step, attn, vs SDPA
    fused_held = find(table(RESULTS / "generate.md", "Agreement"), "KvcxCache fused")   # bytes held, vs FP16
    rss = table(RESULTS / "generate.md", "Peak RSS")  # cache, loaded, prefill s, prefill peak, before decode, ...
    rss_kv, rss_dyn = find(rss, "KvcxCache fused"), find(rss, "DynamicCache")  # the first such row: release_heap on
    kv = find(lmc, "kvcx default")
    eng_t = table(RESULTS / "engine.md", "Time to first token")
    eng_b = find(table(RESULTS / "engine.md", "Bytes stored"), "LMCache, kvcx (default")
    eng_q = table(RESULTS / "engine.md", "Quality")
    t_head = eng_t["configuration"]          # the header row: columns by name, not by position
    eng_4k = dict(zip(t_head, eng_t[("LMCache, kvcx (default scheme)", "4,096")]))
    eng_all = eng_q[("LMCache, kvcx (default scheme)", "all")]
    fp8 = find(lmc, "LMCache fp8")
    q_rel = "[quality](docs/results/quality.md)"
    long_ctx = long_context("long-context-8k.json")
    fam = families()
    low = find(table(RESULTS / "low-bits.md"), "kvcx2v")   # setting, bits, delta, KLD, top-1, codec s
    nq = find(table(RESULTS / "low-bits.md"), "NexusQuant K3V2")
    pre = find(table(RESULTS / "low-bits.md"), "kvcx2v + plan smollm2-kvcx2v-prerope-2.12")
    w247 = find(table(RESULTS / "low-bits.md"), "kvcx2w + plan smollm2-kvcx2w-2.47")
    lines = [
        "| what | measured | report |",
        "|---|---|---|",
        f"| default scheme (`kvcx`) | {quality('kvcx default')} | {q_rel} |",
        f"| kvcx2 + plan `smollm2-kvcx2-3.50` | {quality('kvcx2 + per-layer plan smollm2-kvcx2-3.50')} | {q_rel} |",
        f"| kvcx2w + plan `smollm2-kvcx2w-2.47` | {quality('kvcx2w + query weights')} | {q_rel} |",
        f"| `kvcx2v`, no calibration (E8P lattice values) vs NexusQuant K3V2 | {low[2]} perplexity at {low[1]} "
        f"bits/value, KLD {low[3]}, top-1 {low[4]}; NexusQuant {nq[2]} at {nq[1]} bits, KLD {nq[3]} (the same "
        "held-out windows) "
        "| [low bits](docs/results/low-bits.md) |",
        f"| calibrated: kvcx2v + plan `smollm2-kvcx2v-prerope-2.12` (keys coded before RoPE) vs "
        f"`smollm2-kvcx2w-2.47` | {pre[2]} perplexity at {pre[1]} bits/value, KLD {pre[3]}, top-1 {pre[4]}; the 2.47 "
        f"plan {w247[2]} at {w247[1]} bits, KLD {w247[3]} (the same held-out windows) "
        "| [low bits](docs/results/low-bits.md) |",
        f"| engines' 4-bit KV formats as kvcx emulates them byte for byte: `nvfp4` (TensorRT-LLM), `mxfp4` (ggml), "
        f"`turboquant_4bit_nc` (vLLM) | {engine_formats(q)} | {q_rel} |",
        f"| the reference design (`reference`) | {quality('reference')} | {q_rel} |",
        f"| peer: TurboQuant 3-bit | {quality('peer: TurboQuant 3-bit')} | {q_rel} |",
        f"| peer: quanto int4 | {quality('peer: quanto int4')} | {q_rel} |",
        f"| encode / decode (reference scheme, 2 threads) | {ref[2]} / {ref[4]} GB/s: {ref[8]}x / {ref[10]}x a "
        f"memory copy | [codec](docs/results/codec.md) |",
        f"| decode after 8,000 tokens, `KvcxCache` fused vs `DynamicCache` | {fused8k[2]} tok/s, {fused8k[3]} end "
        f"to end; attention {fused8k[7]} SDPA | [generate](docs/results/generate.md) |",
        f"| memory held, `KvcxCache` fused | {fused_held[4]} an FP16 `DynamicCache` (everything reachable) | "
        "[generate](docs/results/generate.md) |",
        f"| process RSS after an 8,000-token prompt, `KvcxCache` vs `DynamicCache` | {rss_kv[4]} vs {rss_dyn[4]} "
        f"(peak during the prefill {rss_kv[3]} vs {rss_dyn[3]}) | [generate](docs/results/generate.md) |",
        f"| inside vLLM (CPU) with LMCache's server, kvcx vs the default serde | {eng_b[2]} the bytes a token "
        f"({eng_b[3]} fp8's); time to first token from the store at 4k tokens {eng_4k[_col(t_head, 'vs vLLM alone')]} "
        f"vLLM alone's prefill, {eng_4k['vs default serde']} the default serde's; teacher-forced greedy agreement "
        f"{eng_all[2]} | "
        "[engine](docs/results/engine.md) |",
        long_ctx,
        fam,
        mla(),
        f"| LMCache chunk, kvcx serde vs LMCache fp8 | {kv[2]} vs {fp8[2]} smaller than BF16; serialize "
        f"{kv[7]} vs {fp8[7]} GB/s, deserialize {kv[9]} vs {fp8[9]} GB/s (2 threads) | "
        "[lmcache](docs/results/lmcache.md) |",
    ]
    return "Headline figures (2 CPU cores; every figure from the linked report, written by the bench script " \
           "named there, which names the machine and the date of its run):\n\n" + "\n".join(lines)


def engine_formats(q: dict) -> str:
    """The engines' 4-bit formats' quality row cell: each one's perplexity delta, KLD and bits (quality.md)."""
    cells = []
    for name in ("nvfp4", "mxfp4", "turboquant_4bit_nc"):
        r = find(q, f"engine: {name} (")   # setting, bits, ratio, RMSE, SNR, ppl, delta, KLD, top-1, ms
        cells.append(f"`{name}` {r[6]} at {r[1]} bits (KLD {float(r[7]):.4f})")
    return "; ".join(cells) + " (the same windows as the default's row)"


def families() -> str:
    """The headline row of docs/results/families.md: the families whose every decode step ran fused on the CPU, and
    the memory of those with sliding or chunked layers against DynamicCache at 8x the window."""
    path = RESULTS / "families.md"
    rows = [v for k, v in table(path, "Every family").items() if isinstance(k, str) and k != "family"]
    if not rows:
        raise SystemExit("publish: no family rows in docs/results/families.md; run bench.bench_families")
    fused = [r for r in rows if r[3].split(" ")[0] == r[3].split(" ")[2]]
    windowed = [float(r[4].rstrip("x")) for r in rows if ("sliding" in r[1] or "chunked" in r[1]) and "kept" not in r[1]]
    title = re.search(r"\(8x a ([\d,]+)-token window\)", path.read_text())
    window = title.group(1) if title else "?"
    trained = ""
    page = RESULTS / "families-trained.md"
    if page.is_file():   # the same models trained on WikiText's bytes: the greedy tokens of the default scheme
        t_rows = [v for k, v in table(page, "Every family trained").items() if isinstance(k, str) and k != "family"]
        shares = [float(r[2].split("%")[0]) for r in t_rows]
        if shares:
            trained = (f"; trained briefly on WikiText-2's bytes, the default scheme keeps >= 90 % of DynamicCache's "
                       f"greedy tokens in {sum(x >= 90 for x in shares)} of {len(shares)} rows "
                       f"([trained](docs/results/families-trained.md))")
    return (f"| every model family of 2026, `KvcxCache` (tiny models from transformers' configs) | {len(rows)} "
            f"rows run (13 families, Gemma 4 untempered, DeepSeek V4 with layers kept); every decode step fused "
            f"on the CPU in {len(fused)} (MLA decodes its latent and attends over it with kv_b_proj absorbed, "
            f"stated); sliding/chunked hybrids hold {min(windowed):.3f}x-{max(windowed):.3f}x DynamicCache's bytes at "
            f"8x a {window}-token window{trained} | [families](docs/results/families.md) |")


def mla() -> str:
    """The headline row of docs/results/mla.md: the longest context's decode step, KvcxCache (kv_b_proj absorbed)
    against DynamicCache, and the bytes held."""
    rows = [v for k, v in table(RESULTS / "mla.md").items() if isinstance(k, tuple) and k[0] != "context"]
    if not rows:
        raise SystemExit("publish: no rows in docs/results/mla.md; run bench.bench_mla")
    longest = max({r[0] for r in rows}, key=lambda c: int(c.replace(",", "")))
    dyn = next(r for r in rows if r[0] == longest and r[1].startswith("DynamicCache"))
    ours = next(r for r in rows if r[0] == longest and "absorbed" in r[1])
    return (f"| MLA decode (a DeepSeek-V3-shaped attention), `KvcxCache` vs `DynamicCache` | a step after {longest} "
            f"tokens {ours[2]} vs {dyn[2]} ms ({ours[3]}): the latent attended with kv_b_proj absorbed, never "
            f"expanded; the cache {ours[6]} DynamicCache's bytes | [MLA](docs/results/mla.md) |")


def long_context(name: str) -> str:
    """The headline row of a long-context run (bench.bench_retrieval --ppl-windows's JSON): the 1.0-bit calibrated plan's
    retrieval beside the exact cache's and beside eviction alone at about the same bytes."""
    runs = json.loads((RESULTS / name).read_text())["retrieval"]

    def cells(r):
        kept = [c for c in r["cells"] if c["kept"]]
        return sum(c["correct"] for c in kept), sum(c["prompts"] for c in kept), sum(c["exact_correct"] for c in kept)

    plan = next((r for r in runs if r["setting"].endswith("snapkv-1.0")), None)
    if plan is None:
        raise SystemExit(f"publish: {name} has no calibrated 1.0-bit plan; run bench.bench_retrieval --ppl-windows with it")
    near = [r for r in runs if r["config"].get("scheme") == "exact" and abs(r["bits_per_value"] -
                                                                             plan["bits_per_value"]) < 0.1]
    got, n, exact = cells(plan)
    length = plan["lengths"][0]
    alone = ", ".join(f"`{r['setting']}` {cells(r)[0]}/{n}" for r in near)
    what = (f"| long context, {length:,} tokens: bits x keep plan at {plan['bits_per_value']:.3f} bits/value-equivalent "
            f"({plan['compression_ratio']:.1f}x vs FP16, everything counted) | passkey {got}/{n} (exact cache {exact}/{n})")
    return (f"{what}; eviction alone at "
            f"{near[0]['bits_per_value']:.3f} bits: {alone} | [long context](docs/results/{name[:-5]}.md) |"
            if near else
            f"{what} | [long context](docs/results/{name[:-5]}.md) |")


def _col(header: list, start: str) -> str:
    """The name of the first column whose header starts with ``start``."""
    for h in header:
        if h.startswith(start):
            return h
    raise SystemExit(f"publish: no column starting with {start!r}; run the bench that writes it")


def engines(window: str = "1,024", name: str = "engines.md", prefix: str = "docs/") -> str:
    """The section "Windows of ``window``" of an engine-formats report as it was written: the lines that name
    its run, the table and its cost."""
    lines = (RESULTS / name).read_text().splitlines()
    try:
        start = lines.index(f"## Windows of {window}")
    except ValueError:
        raise SystemExit(f"publish: {name} has no section 'Windows of {window}'; run bench_engines.py --at") from None
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    section = lines[start:end]
    run = next(x for x in section if x.startswith("Embedded "))
    rows = [x for x in section if x.startswith("|")]
    cost = next(x for x in section if x.startswith(("Cost of the shared pass", "All ")))
    return run + "\n\n" + "\n".join(rows) + "\n\n" + cost + \
        f"\n\nFrom [docs/results/{name}]({prefix}results/{name}) (its command is at its top)."


def passkey(prefix: str = "docs/") -> str:
    """The passkey grid of docs/results/passkey.md as it was written: its description, its table (a cell a length)
    and its wall time; the per-depth table stays on the page."""
    lines = (RESULTS / "passkey.md").read_text().splitlines()
    start = next(i for i, x in enumerate(lines) if x.startswith("Embedded "))
    first = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("|"))
    end = next((i for i in range(first, len(lines)) if not lines[i].startswith("|")), len(lines))
    wall = next(x for x in lines if x.startswith("Wall time"))
    body = "\n".join(lines[start:end]).strip()
    return body + f"\n\n{wall}\n\nFrom [docs/results/passkey.md]({prefix}results/passkey.md) (its command is at its " \
        "top; per depth there too)."


def validate_output(log: Path) -> str:
    keep = []
    for line in log.read_text(errors="replace").splitlines():
        line = re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", line)
        if "it/s]" in line or "GGUF tensors" in line or "Loading weights" in line or line.startswith(".venv/bin"):
            continue
        keep.append(line.rstrip())
    return "```\n" + "\n".join(keep).strip() + "\n```"


def replace_region(text: str, name: str, body: str) -> str:
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    if begin not in text or end not in text:
        raise SystemExit(f"publish: no region {name!r} where publish writes it (README.md, docs/)")
    a, b = text.index(begin) + len(begin), text.index(end)
    return text[:a] + "\n" + body + "\n" + text[b:]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--validate-log", type=Path, default=None, help="the output of one `make validate` run")
    args = ap.parse_args(argv)
    regions = {ROOT / "README.md": {"headline": headline()},
               ROOT / "docs" / "guide" / "cli.md": {"engines": engines("1,024", prefix="../"),
                                                   "engines-8k": engines("8,192", prefix="../"),
                                                   "passkey": passkey(prefix="../")}}
    if args.validate_log is not None:
        regions[ROOT / "docs" / "getting-started.md"] = {"validate": validate_output(args.validate_log)}
    for path, bodies in regions.items():
        text = path.read_text()
        for name, body in bodies.items():
            text = replace_region(text, name, body)
        path.write_text(text)
        print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
