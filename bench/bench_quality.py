"""Quality of kvcx codec settings on the real embedded model (SmolLM2-135M) and WikiText-2.

For every window the context cache is built once and scored exactly once; each
setting then compresses that same cache (through the packed file format) and
scores the same continuation tokens, so all rows share windows and tokens.

    python bench/bench_quality.py --max-windows 64 --markdown quality.md

Columns: bits/value (codes + scales + zero points + exact sink tokens, from the
packed tensors' bytes), compression ratio vs FP16, RMSE / SNR of the cache
values, perplexity delta vs the exact cache, and on the same scored tokens the
mean KL divergence of the next-token distributions and the top-1 agreement.
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvcx.codec import IntCodec  # noqa: E402
from kvcx.metrics import ErrorStats, error_stats  # noqa: E402
from kvcx.kvconfig import KVConfig  # noqa: E402

DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared/data/wikitext-2-raw/wiki.test.raw"


def custom(name, key, value):
    return name, KVConfig(key=IntCodec(**key), value=IntCodec(**value), scheme=name)


def settings(full: bool):
    asym_ch = dict(scheme="asymmetric", axis="channel")
    rows = [
        ("reference: sym g64 per-token", KVConfig.from_scheme("reference")),
        ("sym g64 per-token + hadamard", KVConfig.from_scheme("symmetric", rotate=True)),
        ("asym g64 per-token", KVConfig.from_scheme("asymmetric")),
        ("asym g64 per-token + hadamard", KVConfig.from_scheme("asymmetric", rotate=True)),
        ("kivi: K asym per-channel g64, V asym per-token g64", KVConfig.from_scheme("kivi")),
        ("kivi + 1 sink token", KVConfig.from_scheme("kivi", sinks=1)),
        ("kvcx default: K asym per-channel g64 + sink, V sym g64 + hadamard", KVConfig.from_scheme("kvcx")),
        custom("K asym per-channel g64 + sink, V asym g64 + hadamard",
               dict(asym_ch, sinks=1), dict(scheme="asymmetric", rotate=True)),
        custom("K asym per-channel g64, V sym g64 + hadamard",
               asym_ch, dict(scheme="symmetric", rotate=True)),
        custom("K asym per-channel g128, V sym g64 + hadamard",
               dict(asym_ch, group_size=128), dict(scheme="symmetric", rotate=True)),
        custom("K asym per-channel g128 + sink, V sym g64 + hadamard",
               dict(asym_ch, group_size=128, sinks=1), dict(scheme="symmetric", rotate=True)),
        custom("K sym per-channel g64, V sym g64 + hadamard",
               dict(scheme="symmetric", axis="channel"), dict(scheme="symmetric", rotate=True)),
        custom("K asym per-channel g128 + sink, V asym g128 + hadamard",
               dict(asym_ch, group_size=128, sinks=1), dict(scheme="asymmetric", rotate=True, group_size=128)),
        custom("3-bit: K asym per-channel g64 + sink, V asym g64 + hadamard",
               dict(asym_ch, sinks=1, bits=3), dict(scheme="asymmetric", rotate=True, bits=3)),
        ("3-bit: kivi + sink", KVConfig.from_scheme("kivi", sinks=1, bits=3)),
        ("8-bit: sym g64 per-token", KVConfig.from_scheme("symmetric", bits=8)),
    ]
    try:  # the peer users would pick instead, measured on the same windows
        import optimum.quanto  # noqa: F401

        rows.append(("peer: transformers QuantizedCache quanto int4 g64 (nominal 4.5)", "quanto"))
    except ImportError:
        pass
    if full:
        rows += [
            ("2-bit: kivi + sink", KVConfig.from_scheme("kivi", sinks=1, bits=2)),
            ("3-bit: reference layout", KVConfig.from_scheme("symmetric", bits=3)),
        ]
    return rows


def _stats(tensors, decoded) -> ErrorStats:
    total = ErrorStats()
    for k, v in tensors.items():
        total += error_stats(v, decoded[k])
    return total


def quanto_roundtrip(tensors):
    """transformers' QuantoQuantizedLayer (int4, groups of 64, axis 0: its defaults) on the same cache."""
    import torch
    from transformers.cache_utils import QuantoQuantizedLayer

    layer = QuantoQuantizedLayer(nbits=4, axis_key=0, axis_value=0, q_group_size=64, residual_length=128)
    return {k: layer._dequantize(layer._quantize(torch.from_numpy(v).contiguous(), axis=0)).numpy()
            for k, v in tensors.items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-windows", type=int, default=64, help="windows of 1024 tokens, stride 512 (0 = all)")
    ap.add_argument("--dataset-file", type=Path, default=DEFAULT_DATA)
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M GGUF")
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--stride", type=int, default=512)
    ap.add_argument("--full", action="store_true", help="also 2-bit and g32 rows")
    ap.add_argument("--markdown", type=Path, default=None, help="also write the table to this file")
    ap.add_argument("--only", nargs="+", default=None, help="run only the rows whose label contains one of these")
    args = ap.parse_args(argv)

    import torch

    from kvcx import safetensors_io as st
    from kvcx.models import load_dataset_text, load_model_and_tokenizer
    from kvcx.packed import compress_tensors, decompress_tensors
    from kvcx.validation import compare_prefix, window_starts

    t0 = time.perf_counter()
    model, tok, name = load_model_and_tokenizer(args.model, cpu=True)
    text = load_dataset_text(args.dataset_file)
    ids = torch.tensor(tok(text)["input_ids"], dtype=torch.long)
    starts = window_starts(ids.numel(), args.window, args.stride, args.max_windows)
    rows = settings(args.full)
    if args.only:
        rows = [r for r in rows if any(o in r[0] for o in args.only)]
    print(f"# {name}: {len(starts)} windows of {args.window} (stride {args.stride}), {len(rows)} settings",
          file=sys.stderr)

    def kvcx_rt(cfg):
        """Packed file round trip; bytes = the packed tensors' payload (codes, scales, zeros, sinks)."""
        def rt(tensors):
            packed, meta = compress_tensors(tensors, cfg)
            decoded = decompress_tensors(*st.load_with_metadata(st.save(packed, meta)))
            return decoded, sum(x.nbytes for x in packed.values()), _stats(tensors, decoded)
        return rt

    def quanto_rt(tensors):
        decoded = quanto_roundtrip(tensors)
        return decoded, sum(x.size for x in tensors.values()) * 4.5 / 8, _stats(tensors, decoded)

    roundtrips = {label: quanto_rt if cfg == "quanto" else kvcx_rt(cfg) for label, cfg in rows}
    runs = compare_prefix(model, ids, starts, args.window, args.stride, roundtrips,
                          on_window=lambda done, total: print(f"window {done}/{total} "
                                                              f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr))
    first = next(iter(runs.values()))
    base_nll, tokens = first.baseline_nll, first.tokens
    base_ppl = math.exp(base_nll / tokens)
    lines = [
        f"Embedded SmolLM2-135M, WikiText-2 raw test, {len(starts)} windows of {args.window} (stride "
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
        args.markdown.write_text(table + "\n")


if __name__ == "__main__":
    main()
