"""Would kvcx2v's calibrated plan gain from giving some layers' values more bits? (issue 68's calibrated target)

    python -m bench.study_value_options [--markdown docs/results/low-bits-values.md]

``kvcx calibrate --scheme kvcx2v`` plans the keys' mean width a layer; the values are E8P (2.25 bits) in every layer.
This study measures each layer's values alone at E8P and at 4-bit integer codes after the Hadamard rotation (the
default's values, 4.25 bits), the rest of the cache exact, on the windows calibrate measures (4 from window 128),
then allocates keys and values together with the keys' figures of ``bench/plans/measured/measured-kvcx2v-2.1.json``
(the same windows) by the same exact knapsack, at the shipped plan's nominal budget, and scores the joint plan beside
the shipped ``smollm2-kvcx2v-2.12`` on the 16 held-out windows of docs/results/low-bits.md (validate, prefix mode).
The joint plan runs as a round trip: each layer's values through the codec it was given, its keys through the plan's
widths, every byte counted as validate counts the shipped plan's.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from bench.report import Report, held_out_text

DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared/data/wikitext-2-raw/wiki.test.raw"
MEASURED = Path(__file__).resolve().parent / "plans/measured/measured-kvcx2v-2.1.json"
SHIPPED = "smollm2-kvcx2v-2.12"


def value_codecs():
    from kvcx.codecs.intcodec import IntCodec
    from kvcx.codecs.lattice import E8PCodec

    return {"E8P": E8PCodec(sinks=1), "int4": IntCodec(bits=4, group_size=64, rotate=True, sinks=1)}


def _values_of(layers, codec):
    """A round trip compressing the values of ``layers`` with ``codec`` (the rest exact)."""
    from kvcx.codecs import KVConfig
    from kvcx.codecs.kvconfig import is_key_tensor, layer_of
    from kvcx.quality.bridge import roundtrip_tensors

    one = KVConfig(key=codec, value=codec, scheme="study")

    def rt(tensors):
        pick = {n: a for n, a in tensors.items() if layer_of(n) in layers and not is_key_tensor(n)}
        decoded, nbytes, stats = roundtrip_tensors(pick, one)
        return {**tensors, **decoded}, nbytes, stats
    return rt


def joint_roundtrip(plan, upgraded: dict):
    """The plan's round trip with the values of ``upgraded`` layers ({layer: codec}) through their own codec."""
    from kvcx.codecs import KVConfig
    from kvcx.codecs.kvconfig import is_key_tensor, layer_of
    from kvcx.quality.bridge import roundtrip_tensors

    own = {L: KVConfig(key=c, value=c, scheme="study") for L, c in upgraded.items()}

    def rt(tensors):
        parts = {}   # None: the plan's; L: that layer's values, through its own codec
        for n, a in tensors.items():
            parts.setdefault(None if is_key_tensor(n) or layer_of(n) not in own else layer_of(n), {})[n] = a
        decoded, nbytes, stats = roundtrip_tensors(parts.pop(None, {}), plan)
        for L, part in parts.items():
            d, nb, st = roundtrip_tensors(part, own[L])
            decoded.update(d)
            nbytes += nb
            stats += st
        return decoded, nbytes, stats
    return rt


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset-file", type=Path, default=DEFAULT_DATA)
    ap.add_argument("--max-windows", type=int, default=16)
    ap.add_argument("--markdown", type=Path, default=None)
    args = ap.parse_args(argv)
    import dataclasses

    import torch

    from kvcx.api import load_plan, read_plan
    from kvcx.quality.calibrate import DEFAULT_OFFSET, DEFAULT_WINDOWS
    from kvcx.quality.models import load_dataset_text, load_model_and_tokenizer, resolve_model
    from kvcx.quality.scoring import compare_prefix, window_starts
    from kvcx.quality.validation import run_validations
    from kvcx.quality.width_plans import UNITS, knapsack

    t0 = time.perf_counter()
    loaded = load_model_and_tokenizer(resolve_model(None), cpu=True)
    m, tok, _ = loaded
    n_layers = int(m.config.num_hidden_layers)
    ids = torch.tensor(tok(load_dataset_text(args.dataset_file), return_tensors=None)["input_ids"], dtype=torch.long)
    starts = window_starts(ids.numel(), 1024, 512, 0)[DEFAULT_OFFSET:DEFAULT_OFFSET + DEFAULT_WINDOWS]
    codecs = value_codecs()
    runs = compare_prefix(m, ids, starts, 1024, 512, {(t, L): _values_of({L}, c) for L in range(n_layers)
                                                      for t, c in codecs.items()},
                          on_window=lambda d, n: print(f"measuring: window {d}/{n} ({time.perf_counter() - t0:.0f} s)",
                                                       file=sys.stderr))
    vsens = {k: r.mean_kld for k, r in runs.items()}
    saved = json.loads(MEASURED.read_text())
    ksens = {(s["layer"], s["option"]): s["kld"] for s in saved["sensitivity"] if s["kind"] == "key"}
    shipped = load_plan(SHIPPED)
    keys = {n.split(".", 1)[1]: c for n, c in shipped.variants if n.startswith("key.")}
    tags = sorted(keys, key=lambda t: keys[t].bits)
    vtags = list(codecs)
    budget = read_plan(SHIPPED)["budget"]
    cap = int(round(budget * 2 * n_layers * UNITS))
    kch = [[(int(round(keys[t].bits_per_value() * UNITS)), ksens[(L, t)]) for t in tags] for L in range(n_layers)]
    vch = [[(int(round(codecs[t].bits_per_value() * UNITS)), vsens[(t, L)]) for t in vtags] for L in range(n_layers)]
    est_keys, kpick = knapsack(kch, cap - sum(c[0][0] for c in vch), "keys alone")
    est, pick = knapsack(kch + vch, cap, "keys and values")
    upgraded = {L: codecs[vtags[j]] for L, j in enumerate(pick[n_layers:]) if j}
    joint = dataclasses.replace(shipped, layer_bits=tuple((L, tags[pick[L]], shipped.value.bits)
                                                          for L in range(n_layers)))
    rows = {f"{SHIPPED} (keys planned, E8P values)": shipped,
            "keys and values planned together": joint}
    res = run_validations(rows, dataset_file=held_out_text(args.dataset_file), window=1024, stride=512,
                          max_windows=args.max_windows, cpu=True, loaded=loaded,
                          roundtrips={"keys and values planned together": joint_roundtrip(joint, upgraded)})
    out = Report()
    out(f"Each layer's values alone (the rest of the cache exact), KLD on {len(starts)} windows from window "
        f"{DEFAULT_OFFSET} (calibrate's), {runs[(vtags[0], 0)].tokens:,} tokens:\n")
    out("| layer | " + " | ".join(f"{t} ({codecs[t].bits_per_value():g} b)" for t in vtags) + " |")
    out("|---:|" + "---:|" * len(vtags))
    for L in range(n_layers):
        out(f"| {L} | " + " | ".join(f"{vsens[(t, L)]:.6f}" for t in vtags) + " |")
    out("| sum | " + " | ".join(f"{sum(vsens[(t, L)] for L in range(n_layers)):.5f}" for t in vtags) + " |")
    same = [tags[j] for j in kpick] == [kb for _, kb, _ in shipped.layer_bits]
    out(f"\nAt the shipped plan's nominal budget ({budget} bits/value), the summed figures: keys planned alone "
        f"{est_keys + sum(vsens[(vtags[0], L)] for L in range(n_layers)):.5f} (their widths "
        f"{'those of the shipped plan' if same else 'not quite the shipped plan'}'s), keys and values together "
        f"{est:.5f}: values given {', '.join(f'layer {L} {vtags[pick[n_layers + L]]}' for L in upgraded) or 'nothing'}"
        f", keys {', '.join(f'layer {L} {tags[kpick[L]]} -> {tags[pick[L]]}' for L in range(n_layers) if kpick[L] != pick[L]) or 'unchanged'}.\n")
    out(f"Scored on {res[0].windows} held-out windows of {res[0].window} (the test split's second half, "
        f"docs/results/low-bits.md's), {res[0].tokens_scored:,} tokens; exact-cache perplexity "
        f"{res[0].baseline_perplexity:.4f}:\n")
    out("| plan | bits/value (whole file) | perplexity delta | KLD (nats/token) | top-1 agreement |")
    out("|---|---:|---:|---:|---:|")
    for label, r in zip(rows, res):
        out(f"| {label} | {r.bits_per_value:.3f} | {r.delta:+.4f} | {r.kld:.5f} | {100 * r.top1_agreement:.2f}% |")
    out(f"\n(total {time.perf_counter() - t0:.0f} s)")
    if args.markdown:
        out.write(args.markdown, "# kvcx2v's calibrated plan with its values planned too")


if __name__ == "__main__":
    from kvcx.errors import KvcxError

    try:
        main()
    except KvcxError as exc:   # a missing text or plan file: one line, not a traceback
        raise SystemExit(f"study_value_options: {exc}") from None
