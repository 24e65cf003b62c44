"""The gate on every model family: ``kvcx validate`` (prefix, generation and engine modes), ``kvcx calibrate``
(a kvcx3 plan and a kvcx2w plan over query weights) and ``--task ruler`` on the tiny random-weight models of
bench/families.py, with the embedded model's tokenizer (its vocabulary) and WikiText-2's text.

It proves that each part of the gate runs on each family's layer kinds (sliding and chunked windows, linear
attention's states, MLA's latent and RoPE key, sinks, softcaps, per-layer head dims) and what it counts: the bits
a value each mode measures, the layers a plan names and their types. A random model's next-token distribution is
flat, so its KLD and top-1 columns measure near-ties, not quality (quality: the embedded model, quality.md).

    python -m bench.bench_families_gate --markdown docs/results/families-gate.md
"""
from __future__ import annotations

import argparse
import time
from collections import Counter
from pathlib import Path

from bench.families import DEFAULT_TEXT, build, family_configs, temper, use_sdpa
from bench.report import Report

MODES = ("prefix", "generation", "engine")


def family_model(name: str, vocab: int, window: int):
    """The family's tiny model (seeded, Gemma 4 tempered as bench_families builds it) with a vocabulary of
    ``vocab`` tokens (the embedded tokenizer's), in its SDPA attention (GPT-OSS's sinks: eager)."""
    cfg = family_configs(window, 4 * window)[name]()
    cfg.vocab_size = vocab
    if getattr(cfg, "vocab_size_per_layer_input", None):   # Gemma 4's per-layer embeddings read the same ids
        cfg.vocab_size_per_layer_input = vocab
    return use_sdpa(temper(build(cfg), name))


def gate_row(name: str, model, tok, text: Path, window: int) -> dict:
    """Every part of the gate on one family: {part: figures, or the error it raised}."""
    from kvcx.codecs import KVConfig
    from kvcx.errors import KvcxError
    from kvcx.quality.calibrate import run_calibration
    from kvcx.quality.retrieval import run_retrieval
    from kvcx.quality.validation import run_validation

    loaded = (model, tok, name)
    row = {}
    for mode in MODES:
        r = run_validation(KVConfig.from_scheme(), dataset_file=text, max_windows=2, loaded=loaded, mode=mode,
                           window=window, stride=window // 2)
        row[mode] = (r.kld, r.top1_agreement, r.bits_per_value, r.config.get("latent_layers", []))
    for scheme, budget in (("kvcx3", 3.0), ("kvcx2w", 2.6)):
        try:
            cal = run_calibration(KVConfig.from_scheme(scheme), budget, dataset_file=text, windows=1, offset=0,
                                  window=window, stride=window // 2, loaded=loaded)
            row[scheme] = (cal.bits_per_value, cal.layer_indices, cal.layer_types)
        except KvcxError as exc:   # a plan the family cannot take: its reason is the row's figure
            row[scheme] = str(exc)
    r = run_retrieval({"kvcx": KVConfig.from_scheme()}, ["niah_single"], lengths=[window], depths=[0.5], prompts=1,
                      dataset_file=text, loaded=loaded)[0]
    row["ruler"] = r.bits_per_value
    return row


def _plan(cell) -> str:
    if isinstance(cell, str):
        return "refused: " + cell.split(": ", 1)[-1].split(":")[0].split(";")[0]   # its first clause
    bits, layers, types = cell
    kinds = sorted({t.replace("_attention", "") for _, t in types}) if types else ["full"]
    return f"{bits:.2f} over {len(layers)} layers ({', '.join(kinds)})"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--window", type=int, default=512, help="the gate's window in tokens (the families' windowed "
                    "layers hold a quarter of it)")
    ap.add_argument("--families", nargs="+", default=None, help="family names of bench/families.py (default: all)")
    ap.add_argument("--text", type=Path, default=DEFAULT_TEXT, help="the evaluation text (WikiText-2's test split)")
    ap.add_argument("--markdown", type=Path, default=None, help="also write the table to this file")
    args = ap.parse_args(argv)
    names = list(family_configs())
    unknown = [n for n in args.families or () if n not in names]
    if unknown or args.window < 256 or args.window % 4:
        ap.error(f"--families {unknown or ''} / --window {args.window}: families of {', '.join(names)}; a window of "
                 "256 tokens or more, a multiple of 4")
    if not args.text.is_file():
        ap.error(f"--text {args.text}: no such file (WikiText-2's wiki.test.raw)")
    from kvcx.cache.layer_types import layer_specs
    from kvcx.quality.models import load_model_and_tokenizer

    _, tok, _ = load_model_and_tokenizer(cpu=True)
    out = Report()
    out("| family | layers | prefix: KLD / top-1 / bits | generation: KLD / top-1 | engine: KLD / top-1 / bits | "
        "MLA layers named | kvcx3 plan (bits) | kvcx2w plan (bits) | ruler (bits) | s |")
    out("|---|---|---|---|---|---|---|---|---|---:|")
    for name in args.families or names:
        t = time.perf_counter()
        model = family_model(name, len(tok), args.window // 4)
        kinds = Counter(s.type.replace("_attention", "") for s in layer_specs(model.config))
        row = gate_row(name, model, tok, args.text, args.window)
        p, g, e = (row[m] for m in MODES)
        out(f"| {name} | {' + '.join(f'{n} {k}' for k, n in kinds.items())} | {p[0]:.2e} / {p[1]:.3f} / {p[2]:.2f} | "
            f"{g[0]:.2e} / {g[1]:.3f} | {e[0]:.2e} / {e[1]:.3f} / {e[2]:.2f} | {', '.join(map(str, p[3])) or '-'} | "
            f"{_plan(row['kvcx3'])} | {_plan(row['kvcx2w'])} | {row['ruler']:.2f} | {time.perf_counter() - t:.0f} |")
    if args.markdown:
        out.write(args.markdown, "# The gate on every model family\n\n"
                  "`kvcx validate` in its three modes (the default scheme, 2 windows of "
                  f"{args.window} tokens, the second half scored), `kvcx calibrate` (a kvcx3 plan at 3.0 bits and a "
                  "kvcx2w plan over query weights at 2.6, one window) and `--task ruler` (niah_single, one prompt) "
                  "on the tiny random-weight models of bench/families.py (4 layers; the windowed layers' window a "
                  f"quarter of the gate's, {args.window // 4} tokens, so it wraps), with the embedded model's "
                  "tokenizer and WikiText-2's text (bench/bench_families_gate.py). They prove that every part of the "
                  "gate runs on each family's layer kinds and what it counts; a random model's next-token "
                  "distribution is flat, so the KLD and top-1 columns measure its near-ties, not quality (quality: "
                  "the embedded model, [quality](quality.md)). Bits a value: prefix and engine modes count the "
                  "packed bytes; generation mode counts KvcxCache whole (its full-precision residual and the "
                  "decode scratch too), so it is not shown. MLA: the latent with the keys' codec, the RoPE key at 8 "
                  "bits (the layers named in the setting, `latent_layers`); a plan's bits are nominal, over the "
                  "layers it names.")


if __name__ == "__main__":
    main()
