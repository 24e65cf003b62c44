"""Query weights read where the attention reads the queries, against the projection's outputs they were read from
before: ``--scheme kvcx2w``'s keys take a bit width per channel, weighed by how much the queries weigh each key
channel (:mod:`kvcx.quality.query_weights`). Until 2026-12-07 those weights were the squares of ``q_proj``'s outputs
(its first heads x head_dim); in the 2026 families the attention's queries are not those outputs: Qwen3, Qwen3-MoE,
Gemma 3 and Gemma 4 normalise each head (``q_norm``), OLMo 3 the whole width, Qwen 3.5 splits an output gate off every
head of ``q_proj``, Llama 4 normalises after the rotary embedding. The weights are now read where the model hands the
queries to transformers' attention function (:mod:`kvcx.cache.query_tap`).

Each family's tiny random-weight model (bench/families.py, with the embedded tokenizer's vocabulary), its q_norm
weights drawn log-uniform over [0.1, 10] (seeded) so that the norm weighs the channels unevenly as a trained model's
does (a random model's norm weighs every channel 1); the weights measured on 4 windows of 256 tokens, then the
kvcx2w keys (no plan: every layer 2 bits a channel on average) over the two weights scored by ``kvcx validate``
(prefix mode) on 8 other windows: the same bits, the same tokens. Models of random weights: the KLD measures the
codec's error on the flat distributions of a random model (a code path and its direction, not quality).

    python -m bench.bench_query_weights --markdown docs/results/query-weights.md
"""
from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

from bench.bench_families_gate import family_model
from bench.families import DEFAULT_TEXT, family_configs
from bench.report import Report

CAL_OFFSET = 400_000   # characters into the text where the weights' windows start (the scored windows: its start)


def projection_query_sums(model, ids, starts, window, layers, shapes):
    """The previous reading (the baseline): each layer's ``q_proj`` outputs (or a fused ``qkv_proj``'s first
    heads x head_dim; ``shapes``: each layer's (heads, KV heads, head_dim) as window_query_sums gave them), summed
    as :func:`kvcx.quality.query_weights.window_query_sums` sums the queries."""
    import torch

    from kvcx.deps import decoder_of

    decoder = decoder_of(model)
    attns = [decoder.layers[L].self_attn for L in layers]
    projs = [a.q_proj if hasattr(a, "q_proj") else a.qkv_proj for a in attns]
    parts = []

    def hook(i):
        heads, kv_heads, head_dim = shapes[i]

        def f(_module, _inputs, out):
            q = out[..., :heads * head_dim].detach().double().reshape(-1, kv_heads, heads // kv_heads, head_dim)
            parts[-1][0][i] = (q * q).sum(dim=(0, 2)).cpu()
            if i == 0:
                parts[-1][1] += q.shape[0]
        return f

    handles = [m.register_forward_hook(hook(i)) for i, m in enumerate(projs)]
    try:
        with torch.inference_mode():
            for a in starts:
                parts.append([[None] * len(layers), 0])
                decoder(input_ids=ids[a:a + window][None], use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return layers, shapes, parts


def uneven_norms(model, seed: int = 5) -> str:
    """Draw every q_norm's weights log-uniform over [0.1, 10] (Qwen 3.5's norm multiplies by 1 + w); returns how the
    family normalises its queries, for the table."""
    import torch

    g = torch.Generator().manual_seed(seed)
    kinds = set()
    for name, p in model.named_parameters():
        if name.endswith("q_norm.weight"):
            attn = model.get_submodule(name.rsplit(".", 2)[0])
            w = torch.exp(torch.empty(p.shape).uniform_(-2.303, 2.303, generator=g))
            one_plus = float(p.detach().abs().max()) == 0.0   # a zero-initialised norm multiplies by 1 + w
            with torch.no_grad():
                p.copy_(w - 1 if one_plus else w)
            kinds.add("per head" if p.numel() == attn.head_dim else "whole width")
    if any(hasattr(m, "qk_norm") for m in model.modules()):   # Llama 4: an L2 norm of no weights, after RoPE
        kinds.add("L2 after the rotary embedding (no weights)")
    return ", ".join(sorted(kinds)) or "none"


def _query_projections(model):
    """(q_proj, heads x head_dim) of each attention layer that has a q_proj."""
    from kvcx.deps import decoder_of

    for layer in decoder_of(model).layers:
        attn = getattr(layer, "self_attn", None)
        if attn is not None and hasattr(attn, "q_proj"):
            heads = getattr(attn, "num_heads", None) or model.config.num_attention_heads
            yield attn.q_proj, heads * attn.head_dim


def family_row(name: str, tok, text: Path, window: int, cal_windows: int, eval_windows: int) -> dict:
    import torch

    from kvcx.codecs import KVConfig
    from kvcx.quality.query_weights import combine_query_sums, window_query_sums
    from kvcx.quality.validation import run_validation

    model = family_model(name, len(tok), window // 4)
    norm = uneven_norms(model)
    gated = any(getattr(m, "out_features", 0) == 2 * m_heads for m, m_heads in _query_projections(model))
    ids = torch.tensor(tok(text.read_text(encoding="utf-8")[CAL_OFFSET:CAL_OFFSET + 200_000])["input_ids"])
    starts = [i * window for i in range(cal_windows)]
    layers, shapes, parts = window_query_sums(model, ids, starts, window)
    weights = {"now": combine_query_sums(layers, shapes, parts)}
    weights["before"] = combine_query_sums(*projection_query_sums(model, ids, starts, window, layers, shapes))
    a, b = (torch.cat([torch.tensor(weights[k][L]).flatten() for L in layers]) for k in ("before", "now"))
    corr = float(torch.corrcoef(torch.stack([a, b]))[0, 1])
    base = KVConfig.from_scheme("kvcx2w")
    row = dict(norm=norm + (" + output gate" if gated else ""), corr=corr, layers=len(layers))
    for label in ("before", "now"):
        w = weights[label]
        cfg = dataclasses.replace(base, key_weights=tuple((L, tuple(tuple(r) for r in v)) for L, v in w.items()))
        r = run_validation(cfg, dataset_file=text, max_windows=eval_windows, loaded=(model, tok, name),
                           window=window, stride=window // 2)
        row[label] = (r.kld, r.top1_agreement, r.bits_per_value)
    return row


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--window", type=int, default=256, help="tokens a window (the windowed layers hold a quarter)")
    ap.add_argument("--cal-windows", type=int, default=4, help="windows the weights are measured on")
    ap.add_argument("--eval-windows", type=int, default=8, help="windows the keys are scored on")
    ap.add_argument("--families", nargs="+", default=None, help="family names of bench/families.py (default: all "
                    "but DeepSeek V3, whose MLA keys are not weighed per channel)")
    ap.add_argument("--text", type=Path, default=DEFAULT_TEXT, help="the text (WikiText-2's test split)")
    ap.add_argument("--markdown", type=Path, default=None, help="also write the table to this file")
    args = ap.parse_args(argv)
    names = [n for n in family_configs() if "MLA" not in n]
    unknown = [n for n in args.families or () if n not in names]
    if unknown or args.window < 64 or args.window % 4 or min(args.cal_windows, args.eval_windows) < 1:
        ap.error(f"--families {unknown or ''} / --window {args.window}: families of {', '.join(names)}; a window of "
                 "64 tokens or more, a multiple of 4; one window or more each")
    if not args.text.is_file():
        ap.error(f"--text {args.text}: no such file (WikiText-2's wiki.test.raw)")
    from kvcx.quality.models import load_model_and_tokenizer

    _, tok, _ = load_model_and_tokenizer(cpu=True)
    out = Report()
    out("| family | the family's q_norm | correlation of the two weights | q_proj's outputs (before): KLD / top-1 | "
        "the attention's queries (now): KLD / top-1 | KLD now / before | bits a value (both) | s |")
    out("|---|---|---:|---:|---:|---:|---:|---:|")
    ratios = {}
    for name in args.families or names:
        t = time.perf_counter()
        r = family_row(name, tok, args.text, args.window, args.cal_windows, args.eval_windows)
        (kb, tb, bb), (kn, tn, bn) = r["before"], r["now"]
        if bb != bn:
            raise SystemExit(f"{name}: the two keys counted {bb} and {bn} bits a value; they must count the same")
        ratios[name] = (kn / kb, r["corr"])
        out(f"| {name} | {r['norm']} | {r['corr']:.3f} | {kb:.3e} / {tb:.3f} | {kn:.3e} / {tn:.3f} | "
            f"{kn / kb:.2f} | {bn:.2f} | {time.perf_counter() - t:.0f} |")
    moved = {n: q for n, (q, c) in ratios.items() if c < 0.999}
    same = [n for n, (q, c) in ratios.items() if c >= 0.999]
    out("")
    out(f"Where the two readings differ ({len(moved)} of {len(ratios)} families), the KLD of the keys over the "
        f"queries the attention reads is {min(moved.values(), default=1):.2f}x-{max(moved.values(), default=1):.2f}x "
        f"the KLD over q_proj's outputs, at the same bits a value; where they agree ({', '.join(same) or 'none'}: no "
        "query norm, the pairs of each rotary channel averaged alike), the keys are the same.")
    if args.markdown:
        out.write(args.markdown, PAGE)


PAGE = """# Query weights: the queries the attention reads

`--scheme kvcx2w` gives each key channel its own bit width, weighed by how much the queries weigh that channel
(`kvcx calibrate --scheme kvcx2w` measures these query weights). Until 2026-12-07 the weights were the squares of
`q_proj`'s outputs. In the 2026 families the attention's queries are not those outputs: Qwen3, Qwen3-MoE, Gemma 3
and Gemma 4 normalise each head (`q_norm`), OLMo 3 the whole width, Qwen 3.5 splits an output gate off every head of
`q_proj` (the old reading took half its heads' gates for queries), Llama 4 normalises after the rotary embedding.
kvcx now reads the queries where the model hands them to transformers' attention function (`kvcx.cache.query_tap`);
SnapKV's observation window reads them the same way.

Each family's tiny random-weight model (bench/families.py, with the embedded tokenizer's vocabulary), its q_norm
weights drawn log-uniform over [0.1, 10] (seeded), so that the norm weighs the channels unevenly as a trained
model's does (a random model's norm weighs every channel 1). The weights are measured both ways on 4 windows of 256
tokens from the text's middle; then kvcx2w's keys (no plan: every layer 2 bits a channel on average) over each
weighing are scored by `kvcx validate` (prefix mode) on 8 other windows: the same bits, the same tokens, the same
model. On a random model's flat next-token distributions the KLD measures the codec's error in the logits, a code
path and its direction, not a model's quality (quality: the embedded model, a Llama, whose weights do not change)."""

if __name__ == "__main__":
    main()
