"""Where a codec's retrieval loss comes from (issue 51, deliverable 2): on the passkey prompts of one length and
depth, the exact cache's KV tensors and a codec's decoded ones are mixed (one layer exact, keys or values exact,
the needle's tokens exact, a recent window exact) and each mixture answers the same prompts.

    python -m bench.bench_retrieval_loss --length 8192 --depth 0.9 --prompts 25 --scheme kvcx \
        --markdown docs/results/retrieval-loss-8k.md

Two measures per mixture: prompts answered greedily (as `kvcx validate --task passkey`: the same prompts, seed
and depth index), and the teacher-forced log-probability of the exact cache's own reply (nats, summed over its
tokens; the drop from the exact cache's, averaged over prompts): a continuous reading of the same loss that
separates layers where a handful of prompts cannot. ``--codecs`` adds other codecs (whole, not mixed) to the
greedy table: ``kvcx:sinks=4``, ``kvcx:key_group=32``, ``kvcx:key_bits=8``.

``--write-plan PATH`` writes the fix this measures as a plan (`kvcx validate --plan`, `KvcxCache(kv_config=
kvcx.api.load_plan(PATH))`): the scheme with 8-bit keys in every layer whose keys alone, coded, cost at least
``--protect`` of the whole loss (the teacher-forced drop with every layer coded). ``--from-json`` writes it from an
earlier run's JSON without running the model. Check such a plan on other prompts (`bench.bench_retrieval --seed 1
--plans PATH`): the layers are chosen on these.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def codec_setting(spec: str):
    """A KVConfig from ``scheme[:key=value,...]`` (sinks, group, key_group, key_bits, value_bits)."""
    from kvcx.codecs.intcodec import IntCodec
    from kvcx.codecs.kvconfig import KVConfig

    scheme, _, opts = spec.partition(":")
    kw = dict(o.split("=") for o in opts.split(",") if o)
    cfg = KVConfig.from_scheme(scheme, sinks=int(kw["sinks"]) if "sinks" in kw else None,
                               group_size=int(kw["group"]) if "group" in kw else None)
    key, value = cfg.key, cfg.value
    if "key_group" in kw or "key_bits" in kw:
        key = IntCodec.from_config({**key.get_config(), "group_size": int(kw.get("key_group", key.group_size)),
                                    "bits": int(kw.get("key_bits", key.bits))})
    if "value_bits" in kw:
        value = IntCodec.from_config({**value.get_config(), "group_size": value.group_size,
                                      "bits": int(kw["value_bits"])})
    return KVConfig(key=key, value=value, scheme=spec)


def layer_losses(forced: dict) -> tuple:
    """(each layer's loss with it alone coded, the loss with every layer coded): means over the prompts, nats."""
    import numpy as np

    exact = np.array(forced["exact"])
    coded = [k for k in forced if k not in ("exact", "keys exact", "values exact") and not k.startswith("layer ")]
    whole = float((exact - np.array(forced[coded[0]])).mean())
    losses, i = [], 0
    while f"layer {i} only coded" in forced:
        losses.append(float((exact - np.array(forced[f"layer {i} only coded"])).mean()))
        i += 1
    return losses, whole


def guard_plan(scheme: str, forced: dict, protect: float, path, model: str) -> list:
    """Write ``scheme`` with 8-bit keys in the guarded layers (kvcx.quality.guard's rule on this bench's figures:
    a layer's keys and values alone coded) to ``path``, a plan file naming its model; the layers."""
    from kvcx.formats.atomic import OutputSet, write_bytes_to
    from kvcx.quality.guard import guard_config, guarded_layers

    losses, whole = layer_losses(forced)
    layers = guarded_layers(losses, whole, protect)
    cfg = guard_config(codec_setting(scheme), layers)
    record = {"model": model, "n_layers": len(losses), "bits_per_value": cfg.bits_per_value(len(losses)),
              "config": cfg.get_config()}
    with OutputSet([path]) as tmp:
        write_bytes_to(tmp[str(path)], str(path), [(json.dumps(record, indent=1) + "\n").encode()])
    print(f"{path}: keys at 8 bits in layers {', '.join(map(str, layers)) or 'none'} "
          f"({record['bits_per_value']:.3f} bits/value nominal)")
    return layers


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--depth", type=float, default=0.9)
    ap.add_argument("--depth-index", type=int, default=0, help="the depth's index in validate's --depths (the seed)")
    ap.add_argument("--prompts", type=int, default=25)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--scheme", default="kvcx", help="the codec whose loss is taken apart")
    ap.add_argument("--layers", default="7,18,23", help="layers kept exact together (one greedy mixture)")
    ap.add_argument("--recent", default="128,1024", help="recent windows kept exact (greedy mixtures)")
    ap.add_argument("--codecs", default="", help="other codecs answered whole, ';'-separated")
    ap.add_argument("--markdown", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--write-plan", type=Path, default=None, help="write the scheme with the guarded layers' keys at "
                                                                  "8 bits as a plan file")
    ap.add_argument("--protect", type=float, default=0.15, help="share of the whole loss a layer's keys must carry "
                                                                "to be guarded")
    ap.add_argument("--from-json", type=Path, default=None, help="an earlier run's --json: only write the plan")
    args = ap.parse_args(argv)
    if args.from_json:
        saved = json.loads(args.from_json.read_text())
        from kvcx.quality.models import resolve_model

        # runs before the JSON named its model ran the one a model-less run loads
        model = saved.get("model") or resolve_model(None).name
        guard_plan(saved["args"]["scheme"], saved["forced"], args.protect, args.write_plan, model)
        return
    import numpy as np
    import torch

    from bench.report import Report
    from kvcx.deps import cache_keyword, decoder_of
    from kvcx.quality import ruler
    from kvcx.quality.bridge import cache_to_tensors, make_dynamic_cache
    from kvcx.quality.models import load_model_and_tokenizer
    from kvcx.quality.retrieval import setting_roundtrip
    from kvcx.quality.scoring import forward_hidden, greedy_reply, output_logits

    t_start = time.perf_counter()
    m, tok, name = load_model_and_tokenizer(None, cpu=True)
    n_layers = m.config.num_hidden_layers
    chosen = [int(x) for x in args.layers.split(",") if x]
    recents = [int(x) for x in args.recent.split(",") if x]
    base = setting_roundtrip(codec_setting(args.scheme))
    others = {spec: setting_roundtrip(codec_setting(spec)) for spec in args.codecs.split(";") if spec}
    decoder = decoder_of(m)
    kw = cache_keyword(decoder.forward)
    eos = getattr(tok, "eos_token_id", None)

    def encode(text):
        return tok(text, add_special_tokens=False)["input_ids"]

    def layers_of(exact, coded, exact_layers=(), kinds=("key", "value"), tokens=None):
        """[(key, value)] torch tensors: ``coded`` with ``exact`` in the given layers / kinds / token slice."""
        out = []
        for i in range(n_layers):
            pair = []
            for kind in ("key", "value"):
                name_ = f"layer_{i}_{kind}"
                if i in exact_layers and kind in kinds:
                    a = exact[name_]
                elif tokens is not None and kind in kinds:
                    a = coded[name_].copy()
                    a[:, :, tokens] = exact[name_][:, :, tokens]
                else:
                    a = coded[name_]
                pair.append(torch.from_numpy(a))
            out.append(tuple(pair))
        return out

    def forced(layers, q, reply, start):
        """Sum of log p(reply | question) over the cache, and the smallest top-1 margin over the reply's tokens."""
        ids = torch.tensor([q + reply[:-1]])
        positions = torch.arange(start, start + ids.shape[1])[None]
        h = decoder(input_ids=ids, position_ids=positions, use_cache=True,
                    **{kw: make_dynamic_cache(layers)}).last_hidden_state[0]
        logp = torch.log_softmax(output_logits(m, h[len(q) - 1:]).float(), -1)
        target = torch.tensor(reply)
        lp = logp[torch.arange(len(reply)), target]
        other = logp.clone()
        other[torch.arange(len(reply)), target] = -float("inf")
        return float(lp.sum()), float((lp - other.max(-1).values).min())

    def answers(layers, q, start, prompt):
        reply = greedy_reply(m, torch.tensor([q]), make_dynamic_cache(layers), prompt.answer_tokens, start, eos,
                             lambda t: prompt.settled(tok.decode(t)))
        return prompt.answered(tok.decode(reply))

    greedy_names = (["exact", args.scheme, f"{args.scheme}, keys exact", f"{args.scheme}, values exact",
                     f"{args.scheme}, the needle's tokens exact"]
                    + [f"{args.scheme}, last {r} tokens exact" for r in recents]
                    + ([f"{args.scheme}, layers {args.layers} exact"] if chosen else []) + list(others))
    greedy = {g: [] for g in greedy_names}
    forced_rows = {g: [] for g in ["exact", args.scheme, "keys exact", "values exact"]
                   + [f"layer {i} exact" for i in range(n_layers)] + [f"layer {i} only coded" for i in range(n_layers)]}
    margins = {g: [] for g in forced_rows}
    with torch.inference_mode():
        for p in range(args.prompts):
            t0 = time.perf_counter()
            prompt = ruler.TASKS["passkey"].build(encode, None, args.length, args.depth,
                                                  ruler.rng_for(args.seed, "passkey", args.length, args.depth_index, p))
            ctx, q = prompt.context, prompt.question
            needle = encode(ruler.NEEDLE.format(key=prompt.answers[0]))
            at = next(i for i in range(len(ctx)) if ctx[i:i + len(needle)] == needle)
            cache = forward_hidden(m, torch.tensor([ctx]))[1]
            exact = cache_to_tensors(cache)
            start = len(ctx)
            reply = greedy_reply(m, torch.tensor([q]), cache, prompt.answer_tokens, start, eos,
                                 lambda t: prompt.settled(tok.decode(t)))
            del cache
            greedy["exact"].append(prompt.answered(tok.decode(reply)))
            coded = base(exact, None)[0]
            every = set(range(n_layers))
            mixtures = {
                args.scheme: layers_of(exact, coded),
                f"{args.scheme}, keys exact": layers_of(exact, coded, every, ("key",)),
                f"{args.scheme}, values exact": layers_of(exact, coded, every, ("value",)),
                f"{args.scheme}, the needle's tokens exact": layers_of(exact, coded, tokens=slice(at, at + len(needle))),
                **{f"{args.scheme}, last {r} tokens exact": layers_of(exact, coded, tokens=slice(start - r, start))
                   for r in recents},
            }
            if chosen:
                mixtures[f"{args.scheme}, layers {args.layers} exact"] = layers_of(exact, coded, set(chosen))
            for spec, rt in others.items():
                mixtures[spec] = layers_of(exact, rt(exact, None)[0])
            for g, layers in mixtures.items():
                greedy[g].append(answers(layers, q, start, prompt))
            rows = {"exact": layers_of(exact, exact), args.scheme: mixtures[args.scheme],
                    "keys exact": mixtures[f"{args.scheme}, keys exact"],
                    "values exact": mixtures[f"{args.scheme}, values exact"]}
            for i in range(n_layers):
                rows[f"layer {i} exact"] = layers_of(exact, coded, {i})
                rows[f"layer {i} only coded"] = layers_of(coded, exact, {i})
            for g, layers in rows.items():
                lp, margin = forced(layers, q, reply, start)
                forced_rows[g].append(lp)
                margins[g].append(margin)
            print(f"prompt {p + 1}/{args.prompts}: exact {greedy['exact'][-1]}, {args.scheme} {greedy[args.scheme][-1]}"
                  f", log p {forced_rows[args.scheme][-1] - forced_rows['exact'][-1]:+.3f}; "
                  f"{time.perf_counter() - t0:.0f} s", flush=True)
    wall = time.perf_counter() - t_start
    ex = np.array(forced_rows["exact"])
    out = Report()
    n = args.prompts
    out(f"Embedded {name}; passkey at {args.length:,} tokens, needle at {100 * args.depth:g} % depth, {n} prompts "
        f"(seed {args.seed}, the prompts of `kvcx validate --task passkey --lengths {args.length} --depths "
        f"{args.depth:g} --prompts {n}`); prefix mode, `{args.scheme}` against the exact cache. A mixture holds the "
        "exact cache's tensors where it says and the codec's decoded ones elsewhere.")
    out("")
    out("Greedy answers (every answer in the reply), on the same prompts:")
    out("")
    out("| setting | answered | lost vs exact | gained |")
    out("|---|---:|---:|---:|")
    e = greedy["exact"]
    for g, a in greedy.items():
        lost = sum(1 for x, y in zip(e, a) if x and not y)
        gained = sum(1 for x, y in zip(e, a) if y and not x)
        out(f"| {g} | {sum(a)}/{n} | {lost} | {gained} |")
    out("")
    out("Teacher-forced: the exact cache's reply scored over each mixture: the drop in its log-probability from the "
        "exact cache's (nats, mean over prompts, and over the prompts the codec loses greedily), and the prompts "
        "whose smallest top-1 margin on the reply is negative (some token of the reply is no longer the greedy "
        "choice).")
    out("")
    lost_idx = [i for i in range(n) if e[i] and not greedy[args.scheme][i]]
    out(f"| mixture | log p drop, all {n} | log p drop, the {len(lost_idx)} lost | margin < 0 |")
    out("|---|---:|---:|---:|")
    for g, lps in forced_rows.items():
        d = ex - np.array(lps)
        lost_d = f"{d[lost_idx].mean():.3f}" if lost_idx else "-"
        out(f"| {g} | {d.mean():.3f} | {lost_d} | {sum(1 for x in margins[g] if x < 0)} |")
    out("")
    out(f"Wall time {wall:.0f} s.")
    if args.json:
        args.json.write_text(json.dumps({"model": name, "greedy": greedy, "forced": forced_rows, "margins": margins,
                                         "args": vars(args) | {"markdown": str(args.markdown),
                                                               "json": str(args.json)}}, indent=1) + "\n")
    if args.write_plan:
        layers = guard_plan(args.scheme, forced_rows, args.protect, args.write_plan, name)
        out(f"\nLayers whose keys alone carry at least {args.protect:.0%} of the loss: "
            f"{', '.join(map(str, layers)) or 'none'}; written as a plan with their keys at 8 bits to {args.write_plan}.")
    if args.markdown:
        out.write(args.markdown, "Where a codec's retrieval loss at long context comes from: the exact cache and the "
                                 "codec's decoded tensors mixed by layer, by kind and by token.")


if __name__ == "__main__":
    main()
