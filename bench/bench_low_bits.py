"""Two bits without calibration: kvcx2v against NexusQuant (Hadamard + E8 lattice, calibration-free) and the default,
scored by ``kvcx validate`` itself (prefix mode) on the same windows and tokens in one run.

    python -m bench.bench_low_bits [--max-windows 16] [--markdown docs/results/low-bits.md]

The windows come from the second half of the test split (``--from-start``: its first windows, validate's own), text
the layout was not chosen on (``--study`` scores the first 8 windows: how the layout was chosen).

Rows: the default (``kvcx``); ``kvcx2v`` (keys with a width per channel, values on the E8P lattice); the same codecs
with 2-bit keys (near 2.25 bits a value: the K2V2 comparison); the default and kvcx2v with ``KvcxCache.for_model``'s
guard (the induction probe's plans, ``kvcx calibrate --guard-induction 3``: 8-bit keys in layers 17, 18, 20); kvcx2v
with the guard measured on its 8k needle (``bench/plans/measured/kvcx2v-guard-8192.json``: 8-bit keys in 7 layers,
docs/results/retrieval-loss-8k-kvcx2v.md); two calibrated plans: ``smollm2-kvcx2w-2.47`` (the queries' weights, one
mean width) and ``smollm2-kvcx2v-2.12`` (kvcx2v with a mean width per layer's keys, reallocated from
``bench/plans/measured/measured-kvcx2v-2.1.json``); NexusQuant K3V2 and K2V2 through its own package (the
``peers`` extra), its bits counted from the codes it emits, fixed-length. kvcx2v, its 2-bit-key form and the plans
also run with their keys coded before RoPE (``kvcx validate --keys-before-rope``, :mod:`kvcx.codecs.rope`), and the
plan measured so: ``smollm2-kvcx2v-prerope-2.12`` (``kvcx calibrate --scheme kvcx2v --keys-before-rope --budget
2.1``, reallocated at 2.12 from ``bench/plans/measured/measured-kvcx2v-prerope-2.1.json``). Bits per value are validate's: the whole
packed file of each window's context cache (codes, scales, ranges, widths, sinks, the header) over its values.
The issue's targets (issue 68): kvcx2v at <= 2.75 bits, delta <= +0.334 and KLD <= 0.0270 (NexusQuant K3V2's on 16
windows); both are also compared with NexusQuant in this run.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from bench.report import Report, held_out_text

DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared/data/wikitext-2-raw/wiki.test.raw"
TARGET_BITS, TARGET_DELTA, TARGET_KLD = 2.75, 0.334, 0.0270   # issue 68: NexusQuant K3V2 on 16 windows
PLANS = Path(__file__).resolve().parent / "plans/measured"   # the probe's plans (kvcx calibrate --guard-induction 3)
GUARDED = "layers 17, 18, 20 keys 8-bit"
# issue 68's calibrated target: <= 2.25 bits counted whole at the delta the 2.47-bit plan reaches (the same windows)
CALIBRATED_BEFORE, CALIBRATED, CALIBRATED_BITS = "smollm2-kvcx2w-2.47", "smollm2-kvcx2v-2.12", 2.25
# kvcx2v's keys coded before RoPE (kvcx.codecs.rope), its plan measured so (`kvcx calibrate --keys-before-rope`)
CALIBRATED_PRE = "smollm2-kvcx2v-prerope-2.12"
PRE = "keys before RoPE"


def settings(peers: bool):
    from kvcx.codecs import KVConfig
    from kvcx.codecs.lattice import E8PCodec
    from kvcx.codecs.widths import WidthCodec

    from kvcx.api import load_plan

    k2 = KVConfig(key=WidthCodec(bits=2.0, group_size=128, sinks=1), value=E8PCodec(sinks=1), scheme="kvcx2v-k2")
    rows = {"kvcx (default)": KVConfig.from_scheme("kvcx"),
            f"kvcx (default), {PRE}": KVConfig.from_scheme("kvcx").with_key_rope("model"),
            "kvcx2v": KVConfig.from_scheme("kvcx2v"),
            f"kvcx2v, {PRE}": KVConfig.from_scheme("kvcx2v").with_key_rope("model"),
            "kvcx2v with 2-bit keys": k2, f"kvcx2v with 2-bit keys, {PRE}": k2.with_key_rope("model")}
    for scheme in ("kvcx", "kvcx2v"):   # KvcxCache.for_model's guard: 8-bit keys in the probe's 3 of 30 layers
        rows[f"{scheme}, for_model's guard ({GUARDED})"] = load_plan(PLANS / f"{scheme}-induction3.json")
    # the measured guard (bench_retrieval_loss --write-plan on kvcx2v's 8k needle figures): 8-bit keys in 7 layers
    rows["kvcx2v, measured 8k guard (layers 2, 7, 15, 18, 20, 21, 23 keys 8-bit)"] = load_plan(
        PLANS / "kvcx2v-guard-8192.json")
    # calibrated: the shipped kvcx2w plan (the queries' weights, one mean width) and kvcx2v's (a mean width a layer)
    rows[f"kvcx2w + plan {CALIBRATED_BEFORE}"] = load_plan(CALIBRATED_BEFORE)
    rows[f"kvcx2v + plan {CALIBRATED}"] = load_plan(CALIBRATED)
    rows[f"kvcx2v + plan {CALIBRATED}, {PRE} (its widths as measured after RoPE)"] = \
        load_plan(CALIBRATED).with_key_rope("model")
    rows[f"kvcx2v + plan {CALIBRATED_PRE} ({PRE}, measured so)"] = load_plan(CALIBRATED_PRE)
    if peers:
        from kvcx.quality.peers import PEERS

        rows["NexusQuant K3V2"] = PEERS["nexusquant-k3v2"]
        rows["NexusQuant K2V2"] = PEERS["nexusquant-k2v2"]
    return rows


def study():
    """How kvcx2v's layout was chosen: its keys' token groups at the same bits (the mean width traded for the ranges'
    two bytes a group), and its values' sink token kept or not."""
    from kvcx.codecs import KVConfig
    from kvcx.codecs.lattice import E8PCodec
    from kvcx.codecs.widths import WidthCodec

    rows = {}
    for g, w in ((32, 158), (64, 174), (128, 182), (256, 186)):   # codes + ranges: 2.97 bits a key at head dim 64
        rows[f"keys {w}/64 bits g{g}, E8P values + sink"] = KVConfig(
            key=WidthCodec(bits=w / 64, group_size=g, sinks=1), value=E8PCodec(sinks=1), scheme=f"study-g{g}")
    rows["keys 174/64 bits g64, E8P values without the sink"] = KVConfig(
        key=WidthCodec(bits=174 / 64, group_size=64, sinks=1), value=E8PCodec(), scheme="study-nosink")
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-windows", type=int, default=16, help="windows of 1,024 tokens, stride 512")
    ap.add_argument("--dataset-file", type=Path, default=DEFAULT_DATA)
    ap.add_argument("--from-start", action="store_true", help="score the text's first windows (validate's own) "
                    "instead of its second half")
    ap.add_argument("--no-peers", action="store_true", help="leave out NexusQuant (it needs the peers extra)")
    ap.add_argument("--markdown", type=Path, default=None, help="also write the table to this file")
    ap.add_argument("--study", action="store_true", help="the layouts kvcx2v was chosen from instead (use 8 windows, "
                    "the first of the 16 the comparison scores)")
    args = ap.parse_args(argv)
    from kvcx.quality.validation import run_validations

    rows = study() if args.study else settings(not args.no_peers)
    t0 = time.perf_counter()
    held_out = not (args.study or args.from_start)
    data = held_out_text(args.dataset_file) if held_out else args.dataset_file
    res = run_validations(rows, dataset_file=data, window=1024, stride=512,
                          max_windows=args.max_windows, cpu=True,
                          on_window=lambda done, total: print(f"window {done}/{total} "
                                                              f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr))
    by = dict(zip(rows, res))
    out = Report()
    first = res[0]
    where = ("its second half (from the first article heading after the middle: text neither the layout's choice, "
             "validate's default windows, bench_quality's nor kvcx calibrate's touch)" if held_out else "its start")
    out(f"Embedded {first.model}, WikiText-2 raw test, {where}: {first.windows} windows of {first.window} (stride "
        f"{first.stride}), {first.tokens_scored:,} tokens scored; exact-cache perplexity "
        f"{first.baseline_perplexity:.4f}. Each row compresses the same context caches and scores the same tokens.\n")
    out("| setting | bits/value (whole file) | perplexity delta | KLD (nats/token) | top-1 agreement | codec s |")
    out("|---|---:|---:|---:|---:|---:|")
    for label, r in by.items():
        out(f"| {label} | {r.bits_per_value:.3f} | {r.delta:+.4f} | {r.kld:.5f} | {100 * r.top1_agreement:.2f}% "
            f"| {r.codec_time_s:.1f} |")
    if not args.study:
        _verdicts(out, by)
    out(f"\n(total {time.perf_counter() - t0:.0f} s)")
    if args.markdown:
        out.write(args.markdown, "# How kvcx2v was chosen: its keys' token groups at the same bits, its values' sink"
                  if args.study else "# Two bits without calibration: kvcx2v, NexusQuant and the default")


def _verdicts(out, by) -> None:
    v = by["kvcx2v"]
    met = v.bits_per_value <= TARGET_BITS and v.delta <= TARGET_DELTA and v.kld <= TARGET_KLD
    out(f"\nkvcx2v: {v.bits_per_value:.3f} bits, delta {v.delta:+.4f}, KLD {v.kld:.5f}; target <= {TARGET_BITS} bits, "
        f"<= +{TARGET_DELTA}, KLD <= {TARGET_KLD} (NexusQuant K3V2's in the issue, 16 windows): "
        f"{'met' if met else 'missed'}.")
    nq = by.get("NexusQuant K3V2")
    if nq is not None:
        out(f"Against NexusQuant K3V2 in this run ({nq.bits_per_value:.3f} bits as fixed-length codes, delta "
            f"{nq.delta:+.4f}, KLD {nq.kld:.5f}): kvcx2v's delta is {v.delta - nq.delta:+.4f}, its KLD "
            f"{v.kld / nq.kld:.2f}x, at {nq.bits_per_value - v.bits_per_value:.2f} fewer bits.")
    c, before = by[f"kvcx2v + plan {CALIBRATED}"], by[f"kvcx2w + plan {CALIBRATED_BEFORE}"]
    met = c.bits_per_value <= CALIBRATED_BITS and c.delta <= before.delta
    out(f"Calibrated: kvcx2v + plan {CALIBRATED} (each layer's keys a mean width, `kvcx calibrate --scheme kvcx2v`) "
        f"{c.bits_per_value:.3f} bits, delta {c.delta:+.4f}, KLD {c.kld:.5f}; target <= {CALIBRATED_BITS} bits at the "
        f"delta of {CALIBRATED_BEFORE} in this run ({before.bits_per_value:.3f} bits, {before.delta:+.4f}, KLD "
        f"{before.kld:.5f}): {'met' if met else 'missed'} (KLD {c.kld / before.kld:.2f}x the 2.47 plan's, at "
        f"{before.bits_per_value - c.bits_per_value:.2f} fewer bits).")
    pre, plain = by[f"kvcx2v + plan {CALIBRATED_PRE} ({PRE}, measured so)"], c
    met = pre.bits_per_value <= CALIBRATED_BITS and pre.delta <= before.delta
    out(f"Calibrated, {PRE}: kvcx2v + plan {CALIBRATED_PRE} (`kvcx calibrate --scheme kvcx2v --keys-before-rope`) "
        f"{pre.bits_per_value:.3f} bits, delta {pre.delta:+.4f}, KLD {pre.kld:.5f} (after RoPE: {plain.delta:+.4f}, "
        f"KLD {plain.kld:.5f}); target <= {CALIBRATED_BITS} bits at the delta of {CALIBRATED_BEFORE} in this run "
        f"({before.delta:+.4f}): {'met' if met else 'missed'} (KLD {pre.kld / before.kld:.2f}x the 2.47 plan's).")
    v2, d, d2 = by[f"kvcx2v, {PRE}"], by["kvcx (default)"], by[f"kvcx (default), {PRE}"]
    out(f"Keys coded before RoPE, the same bits: kvcx2v delta {v.delta:+.4f} -> {v2.delta:+.4f}, KLD {v.kld:.5f} -> "
        f"{v2.kld:.5f} ({v2.bits_per_value:.3f} bits); the default {d.delta:+.4f} -> {d2.delta:+.4f}, KLD "
        f"{d.kld:.5f} -> {d2.kld:.5f}.")
    k2, n2 = by["kvcx2v with 2-bit keys"], by.get("NexusQuant K2V2")
    if n2 is not None:
        out(f"At about 2.25 bits: kvcx2v with 2-bit keys {k2.bits_per_value:.3f} bits, delta {k2.delta:+.4f}, KLD "
            f"{k2.kld:.5f} ({PRE}: delta {by[f'kvcx2v with 2-bit keys, {PRE}'].delta:+.4f}, KLD "
            f"{by[f'kvcx2v with 2-bit keys, {PRE}'].kld:.5f}); NexusQuant K2V2 {n2.bits_per_value:.3f} bits, delta "
            f"{n2.delta:+.4f}, KLD {n2.kld:.5f}.")


if __name__ == "__main__":
    main()
