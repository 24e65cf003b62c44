"""Quality of kvcx codec settings on the real embedded model (SmolLM2-135M) and WikiText-2.

For every window the context cache is built once and scored exactly once; each
setting then compresses that same cache (through the packed file format) and
scores the same continuation tokens, so all rows share windows and tokens.

    python -m bench.bench_quality --max-windows 64 --markdown quality.md

Columns: bits/value (codes + scales + zero points + exact sink tokens, from the
packed tensors' bytes), compression ratio vs FP16, RMSE / SNR of the cache
values, perplexity delta vs the exact cache, and on the same scored tokens the
mean KL divergence of the next-token distributions and the top-1 agreement.
"""
from __future__ import annotations

import argparse
import functools
import math
import sys
import time
from pathlib import Path

import numpy as np

from bench.report import held_out_text
from kvcx.codecs import IntCodec, KVConfig
from kvcx.codecs.metrics import ErrorStats, error_stats
from kvcx.quality.peers import PeerSetting

DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared/data/wikitext-2-raw/wiki.test.raw"




def custom(name, key, value):
    return name, KVConfig(key=IntCodec(**key), value=IntCodec(**value), scheme=name)


# the default before its values kept the sink token; the dropped candidates were measured against it
PREVIOUS_DEFAULT = KVConfig(key=IntCodec(scheme="asymmetric", axis="channel", sinks=1),
                            value=IntCodec(scheme="symmetric", rotate=True), scheme="previous default")


def settings(full: bool, plans, candidates: bool = False):
    asym_ch = dict(scheme="asymmetric", axis="channel")
    rows = [
        ("reference: sym g64 per-token", KVConfig.from_scheme("reference")),
        ("kvcx default: K asym per-channel g64 + sink, V sym g64 + hadamard + sink", KVConfig.from_scheme("kvcx")),
        ("previous default: values without the sink", PREVIOUS_DEFAULT),
        custom("K4 V3: kvcx layout, 3-bit values", dict(asym_ch, sinks=1),
               dict(scheme="symmetric", rotate=True, bits=3)),
        ("kvcx3 preset (every layer 3-bit, K and V sink exact)", KVConfig.from_scheme("kvcx3")),
        ("kvcx2 preset (every layer 2-bit, K and V sink exact)", KVConfig.from_scheme("kvcx2")),
        ("kvcx4w preset (keys: a width per channel, 4 bits on average, g64 + sink; values as kvcx)",
         KVConfig.from_scheme("kvcx4w")),
        ("kvcx2w preset (keys: a width per channel, 2 bits on average, g32; values as kvcx2)",
         KVConfig.from_scheme("kvcx2w")),
    ]
    from kvcx.api import load_plan

    for path in plans:
        cfg = load_plan(path)
        how = "query weights" if cfg.key_weights else "per-layer plan"
        name = Path(path).name[:-len(".json")] if str(path).endswith(".json") else str(path)   # a shipped name
        rows.append((f"{cfg.scheme} + {how} {name}", cfg))
    rows += [
        ("KIVI-style 3-bit: K asym per-channel g64, V asym per-token g64", KVConfig.from_scheme("kivi", bits=3)),
        ("KIVI-style 2-bit", KVConfig.from_scheme("kivi", bits=2)),
    ]
    if candidates:  # measured and not shipped (README "Low bits"); slow NumPy prototypes, so not by default
        rows += [("candidate, dropped: K4, V3 Lloyd-Max levels + per-vector norm after hadamard", "lloyd-v3"),
                 ("candidate, dropped: K3 + 1 exact outlier per group (dense-and-sparse), V4", "outlier-k3"),
                 custom("K4 V2: kvcx layout, 2-bit asym values", dict(asym_ch, sinks=1),
                        dict(scheme="asymmetric", rotate=True, bits=2))]
    rows += [("kvcx2v preset (keys: a width per channel, 2.72 bits on average; values: E8P lattice, no calibration)",
              KVConfig.from_scheme("kvcx2v")),
             # the engines' FP4 and TurboQuant KV formats, byte-exact emulations (docs/results/engines-fp4.md)
             ("engine: nvfp4 (TensorRT-LLM NVFP4 KV: E2M1, E4M3 scale per 16, per-tensor scale 1)",
              KVConfig.from_scheme("nvfp4")),
             ("engine: nvfp4-amax (the same, a calibrated per-tensor scale)", KVConfig.from_scheme("nvfp4-amax")),
             ("engine: mxfp4 (ggml MXFP4: E2M1, E8M0 scale per 32)", KVConfig.from_scheme("mxfp4")),
             ("engine: turboquant_4bit_nc (vLLM TurboQuant: K Hadamard + 4-bit Lloyd-Max, V 4-bit)",
              KVConfig.from_scheme("turboquant_4bit_nc")),
             ("engine: turboquant_3bit_nc (vLLM TurboQuant: K 3-bit Lloyd-Max, V 3-bit)",
              KVConfig.from_scheme("turboquant_3bit_nc"))]
    # the peers users would pick instead, through their own libraries (kvcx.quality.peers, as `kvcx validate
    # --scheme NAME` runs them), on the same windows; a peer not installed is left out
    from kvcx.errors import KvcxError
    from kvcx.quality.peers import PEERS

    for name, label in (("quanto-int4", "quanto int4 g64 (transformers QuantizedCache)"),
                        ("quanto-int2", "quanto int2 g64 (transformers QuantizedCache)"),
                        ("turboquant-4", "TurboQuant 4-bit (fused-turboquant, CPU path)"),
                        ("turboquant-3", "TurboQuant 3-bit (fused-turboquant, CPU path)"),
                        ("nexusquant-k4v4", "NexusQuant K4V4 (Hadamard + E8 lattice; bits as fixed-length codes)"),
                        ("nexusquant-k3v2", "NexusQuant K3V2 (Hadamard + E8 lattice; bits as fixed-length codes)"),
                        ("nexusquant-k2v2", "NexusQuant K2V2 (Hadamard + E8 lattice; bits as fixed-length codes)")):
        try:
            PEERS[name].check_installed()
        except KvcxError:
            continue
        rows.append((f"peer: {label}", PEERS[name]))
    if full:
        rows += [("8-bit: sym g64 per-token", KVConfig.from_scheme("symmetric", bits=8)),
                 ("3-bit: reference layout", KVConfig.from_scheme("symmetric", bits=3))]
    return rows


def default_study():
    """The 4-bit layouts the default was chosen from (docs/RESULTS.md "Choosing the default")."""
    asym_ch, sym_h = dict(scheme="asymmetric", axis="channel"), dict(scheme="symmetric", rotate=True)
    asym_h = dict(scheme="asymmetric", rotate=True)
    rows = [
        ("reference: sym g64 per-token (--scheme reference)", KVConfig.from_scheme("reference")),
        custom("sym g64 per-token + hadamard", dict(scheme="symmetric"), sym_h),
        ("asym g64 per-token (--scheme asymmetric)", KVConfig.from_scheme("asymmetric")),
        custom("asym g64 per-token + hadamard", dict(scheme="asymmetric", rotate=True), asym_h),
        ("KIVI: K asym per-channel g64, V asym per-token g64 (--scheme kivi)", KVConfig.from_scheme("kivi")),
        ("KIVI + 1 sink token", KVConfig.from_scheme("kivi", sinks=1)),
        custom("K asym per-channel g64 + sink, V asym g64 + hadamard", dict(asym_ch, sinks=1), asym_h),
        ("kvcx default: K asym per-channel g64 + sink, V sym g64 + hadamard + sink", KVConfig.from_scheme("kvcx")),
        ("previous default: values without the sink", PREVIOUS_DEFAULT),
        custom("K asym per-channel g64 (no sink), V sym g64 + hadamard", asym_ch, sym_h),
        custom("K asym per-channel g128 + sink, V sym g64 + hadamard", dict(asym_ch, sinks=1, group_size=128), sym_h),
        custom("K asym per-channel g128, V sym g64 + hadamard", dict(asym_ch, group_size=128), sym_h),
        custom("K sym per-channel g64, V sym g64 + hadamard", dict(scheme="symmetric", axis="channel"), sym_h),
        custom("K asym per-channel g128 + sink, V asym g128 + hadamard", dict(asym_ch, sinks=1, group_size=128),
               dict(asym_h, group_size=128)),
        custom("3-bit: K asym per-channel g64 + sink, V asym g64 + hadamard", dict(asym_ch, sinks=1, bits=3),
               dict(asym_h, bits=3)),
        ("3-bit: KIVI + sink", KVConfig.from_scheme("kivi", bits=3, sinks=1)),
        ("8-bit: sym g64 per-token", KVConfig.from_scheme("symmetric", bits=8)),
    ]
    from kvcx.errors import KvcxError
    from kvcx.quality.peers import PEERS

    try:
        PEERS["quanto-int4"].check_installed()
        rows.insert(4, ("peer: quanto int4 g64 (transformers QuantizedCache)", PEERS["quanto-int4"]))
    except KvcxError:
        pass
    return rows


def _short(label: str) -> str:
    """A row's name on the Pareto chart."""
    for prefix in ("peer: ", "engine: ", "candidate, dropped: "):
        if label.startswith(prefix):
            return ("(dropped) " if "dropped" in prefix else "") + label[len(prefix):].split(" (")[0].split(":")[0]
    for how in (" + per-layer plan ", " + query weights "):  # "kvcx2 + per-layer plan smollm2-kvcx2-3.54"
        if how in label:                                     # -> "kvcx2 + plan 3.54"; "...-kvcx2v-prerope-2.12"
            head, plan = label.split(how)                    # -> "kvcx2v + q-weights prerope-2.12"
            tail = plan.split(f"-{head}-", 1)[1] if f"-{head}-" in plan else plan.rsplit("-", 1)[-1]
            return f"{head} + {'plan' if 'plan' in how else 'q-weights'} {tail}"
    return label.split(":")[0].split(" (")[0]


def _stats(tensors, decoded) -> ErrorStats:
    total = ErrorStats()
    for k, v in tensors.items():
        total += error_stats(v, decoded[k])
    return total


def _hadamard(d):
    h = np.array([[1.0]])
    while h.shape[0] < d:
        h = np.block([[h, h], [h, -h]])
    return (h / np.sqrt(d)).astype(np.float32)


@functools.lru_cache(maxsize=None)
def _lloyd_gauss(bits, n=200_000, iters=100):
    z = np.sort(np.random.default_rng(0).standard_normal(n))
    lv = np.quantile(z, (np.arange(1 << bits) + 0.5) / (1 << bits))
    for _ in range(iters):
        idx = np.searchsorted((lv[1:] + lv[:-1]) / 2, z)
        lv = np.array([z[idx == i].mean() for i in range(1 << bits)])
    return lv.astype(np.float32)


def lloyd_values(v, bits=3):
    """Candidate (NumPy): Hadamard, per-vector FP16 scale refit by least squares, Lloyd-Max Gaussian levels."""
    x = v.astype(np.float32)
    h = _hadamard(x.shape[-1])
    y = x @ h
    lv = _lloyd_gauss(bits)
    bounds = (lv[1:] + lv[:-1]) / 2
    s = np.sqrt((y * y).mean(-1, keepdims=True)) + 1e-12
    for _ in range(2):
        q = lv[np.searchsorted(bounds, y / s)]
        s = (y * q).sum(-1, keepdims=True) / np.maximum((q * q).sum(-1, keepdims=True), 1e-20)
        s = np.where(s > 0, s, 1e-12)
    q = lv[np.searchsorted(bounds, y / s)]
    return ((q * s.astype(np.float16).astype(np.float32)) @ h.T).astype(v.dtype)


def outlier_keys(k, bits=3, group=64, sinks=1):
    """Candidate (NumPy): KIVI keys (asym per channel, groups of 64 tokens) with the one entry per group
    farthest from the group's median kept exact (FP16 value + 6-bit index: 22 bits per group)."""
    x = k.astype(np.float32)
    out = x.copy()
    top = (1 << bits) - 1
    for a in range(sinks, x.shape[-2], group):
        blk = x[..., a:a + group, :]
        dev = np.abs(blk - np.median(blk, axis=-2, keepdims=True))
        keep = dev == dev.max(axis=-2, keepdims=True)
        lo = np.where(keep, np.inf, blk).min(-2, keepdims=True)
        hi = np.where(keep, -np.inf, blk).max(-2, keepdims=True)
        lo = np.where(np.isfinite(lo), lo, 0).astype(np.float16).astype(np.float32)
        hi = np.where(np.isfinite(hi), hi, 0)
        s = np.maximum((hi - lo) / top, 1e-8).astype(np.float16).astype(np.float32)
        r = lo + s * np.clip(np.round((blk - lo) / s), 0, top)
        out[..., a:a + group, :] = np.where(keep, blk, r)
    return out


def candidate_roundtrip(which, tensors):
    from kvcx.formats.packed import compress_tensors

    base = PREVIOUS_DEFAULT  # the candidates' figures in the README were measured beside it
    dec, nbytes = {}, 0
    for name, a in tensors.items():
        key = name.endswith("key")
        if which == "lloyd-v3" and not key:
            dec[name] = lloyd_values(a, 3)
            nbytes += a.size * 3 / 8 + a.size // a.shape[-1] * 2   # codes + one FP16 scale per vector
        elif which == "outlier-k3" and key:
            dec[name] = outlier_keys(a, 3)
            S, D = a.shape[-2], a.shape[-1]
            slabs, groups = a.size // (S * D), -(-(S - 1) // 64)
            # codes + FP16 scale and zero per channel group + the exact sink token + 22 bits per outlier
            nbytes += slabs * ((S - 1) * D * 3 / 8 + groups * D * (4 + 22 / 8) + D * a.itemsize)
        else:
            from kvcx.formats.packed import decompress_tensors

            packed, meta, _ = compress_tensors({name: a}, base)
            dec[name] = decompress_tensors(packed, meta)[name]
            nbytes += sum(x.nbytes for x in packed.values())
    return dec, nbytes


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-windows", type=int, default=64, help="windows of 1024 tokens, stride 512 (0 = all)")
    ap.add_argument("--dataset-file", type=Path, default=DEFAULT_DATA)
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M GGUF")
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--stride", type=int, default=512)
    ap.add_argument("--full", action="store_true", help="also 8-bit and 3-bit reference-layout rows")
    ap.add_argument("--candidates", action="store_true", help="also the candidates measured and dropped (slow)")
    ap.add_argument("--markdown", type=Path, default=None, help="also write the table to this file")
    ap.add_argument("--study", choices=["frontier", "default"], default="frontier",
                    help="frontier: presets, plans, peers (default); default: the 4-bit layouts the default was "
                         "chosen from")
    ap.add_argument("--held-out", action="store_true", help="score the text's second half (from the first article "
                    "heading after the middle) instead of its first windows: text no choice of kvcx's was made on")
    ap.add_argument("--only", nargs="+", default=None, help="run only the rows whose label contains one of these")
    ap.add_argument("--plan", nargs="*", default=None,
                    help="plans from `kvcx calibrate`, files or shipped names (default: every shipped plan)")
    ap.add_argument("--redraw", type=Path, default=None,
                    help="draw --pareto from a table this bench wrote with --markdown, without running the model")
    ap.add_argument("--pareto", type=Path, default=None, help="also draw the Pareto chart to this PNG")
    args = ap.parse_args(argv)
    if args.redraw is not None:
        if args.pareto is None:
            ap.error("--redraw needs --pareto PNG")
        return redraw(args.redraw, args.pareto)

    import torch

    from kvcx.formats import safetensors as st
    from kvcx.formats.packed import compress_tensors, decompress_tensors
    from kvcx.quality.models import load_dataset_text, load_model_and_tokenizer
    from kvcx.quality.scoring import compare_prefix, window_starts

    t0 = time.perf_counter()
    model, tok, name = load_model_and_tokenizer(args.model, cpu=True)
    text = load_dataset_text(held_out_text(args.dataset_file) if args.held_out else args.dataset_file)
    ids = torch.tensor(tok(text)["input_ids"], dtype=torch.long)
    starts = window_starts(ids.numel(), args.window, args.stride, args.max_windows)
    from kvcx.api import shipped_plans

    plans = shipped_plans() if args.plan is None else args.plan
    rows = settings(args.full, plans, args.candidates) if args.study == "frontier" else default_study()
    if args.only:
        rows = [r for r in rows if any(o in r[0] for o in args.only)]
    print(f"# {name}: {len(starts)} windows of {args.window} (stride {args.stride}), {len(rows)} settings",
          file=sys.stderr)

    def kvcx_rt(cfg):
        """Packed file round trip; bytes = the packed tensors' payload (codes, scales, zeros, sinks)."""
        def rt(tensors):
            packed, meta, _ = compress_tensors(tensors, cfg)
            decoded = decompress_tensors(*st.load_with_metadata(st.save(packed, meta)))
            return decoded, sum(x.nbytes for x in packed.values()), _stats(tensors, decoded)
        return rt

    def other_rt(cfg):
        def rt(tensors):
            if isinstance(cfg, PeerSetting):    # its library's round trip; NexusQuant takes RoPE from the config
                return cfg.roundtrip(tensors, model_config=model.config)
            decoded, nbytes = candidate_roundtrip(cfg, tensors)
            return decoded, nbytes, _stats(tensors, decoded)
        return rt

    roundtrips = {label: kvcx_rt(cfg) if isinstance(cfg, KVConfig) else other_rt(cfg) for label, cfg in rows}
    runs = compare_prefix(model, ids, starts, args.window, args.stride, roundtrips,
                          on_window=lambda done, total: print(f"window {done}/{total} "
                                                              f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr))
    first = next(iter(runs.values()))
    base_nll, tokens = first.baseline_nll, first.tokens
    base_ppl = math.exp(base_nll / tokens)
    held_out = " (its second half: text no choice of kvcx's was made on)" if args.held_out else ""
    lines = [
        f"Embedded SmolLM2-135M, WikiText-2 raw test{held_out}, {len(starts)} windows of {args.window} (stride "
        f"{args.stride}), {tokens:,} tokens scored; baseline perplexity {base_ppl:.4f}.",
        "",
        "| setting | bits/value | ratio vs FP16 | RMSE | SNR dB | perplexity | delta | KLD (nats/token) | top-1 agreement | "
        "codec CPU ms / window |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for label, _ in rows:
        r = runs[label]
        bpv = r.bits_per_value
        ppl = r.compressed_ppl
        lines.append(f"| {label} | {bpv:.3f} | {16.0 / bpv:.2f}x | {r.stats.rmse:.4f} | "
                     f"{r.stats.snr_db:.2f} | {ppl:.4f} | {ppl - base_ppl:+.4f} | {r.mean_kld:.5f} | "
                     f"{100 * r.top1_agreement:.2f}% | {1000 * r.codec_cpu_s / len(starts):.1f} |")
    table = "\n".join(lines)
    print(table)
    print(f"\n(total {time.perf_counter() - t0:.0f} s)")
    if args.markdown:
        from bench.report import header

        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        what = ("Quality of kvcx's codecs, presets and plans and of peers on the embedded model" if args.study ==
                "frontier" else "The 4-bit layouts the default was chosen from, on the embedded model")
        args.markdown.write_text(header(what + ": perplexity, KL divergence and top-1 agreement against the exact "
                                        "cache, every row on the same windows and tokens.") + "\n" + table + "\n")
    if args.pareto:
        _draw(args.pareto, [(label, runs[label].bits_per_value, runs[label].compressed_ppl - base_ppl)
                            for label, _ in rows], len(starts))


def _draw(path: Path, results, windows: int) -> None:
    """The Pareto chart of (label, bits/value, delta) rows."""
    from kvcx.quality.plots import pareto_png

    pts = [{"bits": bits, "delta": delta, "label": _short(label),
            "kind": next((k for k, head in (("peer", "peer"), ("engine", "engine:"), ("dropped", "candidate"))
                          if label.startswith(head)), "kvcx")}
           for label, bits, delta in results]
    path.write_bytes(pareto_png(pts, title=f"SmolLM2-135M, WikiText-2, {windows} windows: perplexity delta vs "
                                           "bits/value"))
    print(f"wrote {path}", file=sys.stderr)


def redraw(table: Path, path: Path) -> None:
    """The Pareto chart again from a table this bench wrote (``--markdown``): no model run."""
    text = table.read_text()
    windows = int(text.split(" windows of ")[0].rsplit(" ", 1)[-1].replace(",", ""))
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 10 and cells[1].replace(".", "", 1).isdigit():
            rows.append((cells[0], float(cells[1]), float(cells[6])))
    _draw(path, rows, windows)


if __name__ == "__main__":
    main()
