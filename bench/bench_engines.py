"""Validate what you deploy: kvcx's settings and the engines' KV formats on one model, one text, the same
tokens (`kvcx validate --scheme A,B,...`), at each window size asked for, and what the shared pass costs
against one setting alone.

    python -m bench.bench_engines --all --at 1024:512:32 --at 8192:4096:4 --markdown docs/results/engines.md

`--at WINDOW:STRIDE:MAX_WINDOWS` (repeatable; default 1024:512:32) names the window sizes: one table per
size, in one run, the model loaded once.

Settings (default; `--all` adds iq4_nl and the peers quanto / HQQ / TurboQuant / NexusQuant through their libraries): kvcx's
default and KIVI at 4 bits; llama.cpp's q8_0, q5_1, q4_1, q4_0 as releases before
the attention rotation (or with LLAMA_ATTN_ROT_DISABLE=1) write them, and q8_0, q4_0 with the rotation
(llama.cpp's default since PR #21038); vLLM's fp8 e4m3 and e5m2 at scale 1.0; FP4: ggml's mxfp4 and
TensorRT-LLM's nvfp4 at per-tensor scale 1.0 and calibrated (nvfp4-amax). Timing: at the first window
size, the same windows validated once for the first setting alone and once for all of them in one call; at
every size the wall time of the call and the peak RSS of the process so far.
"""
from __future__ import annotations

import argparse
import resource
import time
from pathlib import Path

DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared/data/wikitext-2-raw/wiki.test.raw"
SETTINGS = "kvcx,kivi,q8_0,q8_0-rot,q5_1,q4_1,q4_0,q4_0-rot,fp8_e4m3,fp8_e5m2,mxfp4,nvfp4,nvfp4-amax"
# every format validate takes (the --all list): the above, iq4_nl, and the peers through their libraries
ALL_SETTINGS = SETTINGS + (",iq4_nl,iq4_nl-rot,quanto-int4,quanto-int2,hqq-int4,hqq-int2,hqq-int4-axis1,"
                            "hqq-int2-axis1,turboquant-4,turboquant-3,nexusquant-k4v4,nexusquant-k3v2,nexusquant-k2v2")


def window_spec(text: str) -> tuple:
    """``"8192:4096:4"`` -> (8192, 4096, 4)."""
    try:
        window, stride, max_windows = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not WINDOW:STRIDE:MAX_WINDOWS (e.g. 8192:4096:4)") from None
    return window, stride, max_windows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scheme", default=SETTINGS, help="settings, comma-separated (any `kvcx validate --scheme`)")
    ap.add_argument("--all", action="store_true", help="every format: " + ALL_SETTINGS)
    ap.add_argument("--at", action="append", type=window_spec, default=None, metavar="WINDOW:STRIDE:MAX_WINDOWS",
                    help="a window size to validate at, repeatable (default 1024:512:32)")
    ap.add_argument("--threshold", type=float, default=0.5)
    ap.add_argument("--dataset-file", type=Path, default=DEFAULT_DATA)
    ap.add_argument("--markdown", type=Path, default=None)
    ap.add_argument("--skip-alone", action="store_true", help="skip the run of the first setting alone (the "
                                                              "shared pass's cost is then not measured)")
    args = ap.parse_args(argv)
    from bench.report import Report

    from kvcx.api import validation_settings
    from kvcx.quality.models import load_model_and_tokenizer
    from kvcx.quality.peers import PEERS

    configs, _ = validation_settings(ALL_SETTINGS if args.all else args.scheme, peers=PEERS)
    t0 = time.perf_counter()
    loaded = load_model_and_tokenizer(None, cpu=True)
    out = Report()
    for n, (window, stride, max_windows) in enumerate(args.at or [(1024, 512, 32)]):
        common = dict(threshold=args.threshold, dataset_file=args.dataset_file, window=window, stride=stride,
                      max_windows=max_windows, loaded=loaded)
        run_size(out, configs, common, alone=not args.skip_alone and n == 0)
    out(f"The whole run (model load included): {time.perf_counter() - t0:.0f} s; peak RSS "
        f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20:.2f} GiB.")
    if args.markdown:
        out.write(args.markdown, "kvcx's settings and the engines' KV formats (llama.cpp, vLLM fp8, FP4) and the peers "
                                 "(quanto, HQQ, TurboQuant) on the embedded model: perplexity, KL divergence and top-1 "
                                 "agreement against the exact cache, every setting on the same windows and tokens, "
                                 "at each window size.")


def run_size(out, configs: dict, common: dict, alone: bool) -> None:
    """Validate every setting at one window size (and the first alone, when ``alone``); print its section."""
    from kvcx.quality.scoring import FORWARD_CHUNK, HEAD_SLICE
    from kvcx.quality.validation import run_validations

    first = next(iter(configs))
    t = time.perf_counter()
    single = run_validations({first: configs[first]}, **common)[0] if alone else None
    t_alone = time.perf_counter() - t
    t = time.perf_counter()
    results = run_validations(configs, **common)
    t_all = time.perf_counter() - t
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20
    # the shared pass changes nothing
    assert single is None or results[0].compressed_perplexity == single.compressed_perplexity
    r0 = results[0]
    out(f"## Windows of {r0.window:,}")
    out("")
    out(f"Embedded {r0.model}, WikiText-2 raw test, {r0.windows} windows of {r0.window} (stride {r0.stride}), "
        f"{r0.tokens_scored:,} tokens scored, {r0.mode} mode; baseline perplexity {r0.baseline_perplexity:.4f}; "
        f"threshold {r0.threshold}.")
    out("")
    out("| setting | what it emulates | bits/value | ratio vs FP16 | perplexity | delta | KLD (nats/token) | "
        "top-1 agreement | verdict |")
    out("|---|---|---:|---:|---:|---:|---:|---:|---|")
    for r in results:
        cfg = configs[r.setting]
        same = getattr(cfg, "key", None) is not None and cfg.key == cfg.value
        what = cfg.key.describe() if same else cfg.describe().split(": ", 1)[-1]
        out(f"| `{r.setting}` | {what} | {r.bits_per_value:.3f} | {r.compression_ratio:.2f}x | "
            f"{r.compressed_perplexity:.4f} | {r.delta:+.4f} | {r.kld:.5f} | {100 * r.top1_agreement:.2f}% | "
            f"{'PASS' if r.passed else 'FAIL'} |")
    out("")
    if single is None:
        out(f"All {len(results)} settings in one call: {t_all:.0f} s. Peak RSS so far {rss:.2f} GiB (model, text, "
            f"caches and scoring; the model runs in chunks of {FORWARD_CHUNK:,} tokens and its output head in "
            f"slices of {HEAD_SLICE} rows).")
    else:
        out(f"Cost of the shared pass: {first} alone {t_alone:.0f} s; all {len(results)} settings in one call "
            f"{t_all:.0f} s = {t_all / t_alone:.2f}x (a setting alone costs a context, a baseline and a compressed "
            f"pass per window; each further setting adds one compressed pass and its codec: in passes "
            f"{len(results)} settings are {len(results) + 2}/3 = {(len(results) + 2) / 3:.2f}x; a compressed pass "
            f"costs less than the context pass, so the time ratio can be lower). Peak RSS so far {rss:.2f} GiB.")
    out("")


if __name__ == "__main__":
    main()
