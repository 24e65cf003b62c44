"""KvcxCache on every model family of 2026: what it packs, whether its steps run fused, the memory it holds against
DynamicCache at 8x the window, and how close its tokens stay (tiny random-weight models from transformers' own
config classes: bench/families.py; they prove code paths and memory, not quality).

    python -m bench.bench_families [--window 256] [--steps 16] [--prompts 8] [--markdown docs/results/families.md]

Per family, batch 1, ``--prompts`` prompts of 8x the window (random tokens, seeds 1..N), each then ``--steps``
greedy tokens:
- FP32, the model's eager attention with DynamicCache(config=...) (the reference) against KvcxCache (the default
  scheme, the ``"kvcx"`` attention): the greedy tokens equal to the reference's (free running: a random model's
  near-tie flips every token after it), the top-1 teacher-forced on the reference's tokens, the mean KL of the
  next-token distributions (nats), counted over all the prompts; the same for KvcxCache with 8-bit codes and for
  vLLM's FP8 cache (a peer, emulated byte-exact); the decode steps of the packed layers that ran fused (the first
  prompt);
- BF16: the model in BF16 with DynamicCache against the FP32 reference's tokens (what the deployment dtype alone
  keeps), and, on the first prompt with both caches in BF16 (so that DynamicCache's bytes are its FP16-equivalent
  bytes), the bytes KvcxCache holds after the 16 tokens (memory_report()'s total: packed, residual, kept layers'
  states, scratch, workspace) against the bytes DynamicCache(config=...) holds (its sliding layers bounded too:
  like with like).
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from bench.families import (DEFAULT_TEXT, TRAIN_SHARE, attention_branch, build, decode, family_configs, kl, prompts,
                            temper, text_bytes, text_prompts, train, unsupported_config)
from bench.report import Report

TARGET_MEMORY = 0.45   # the bound for the families with 3 sliding (or chunked) layers to 1 full
TARGET_TOKENS = 0.9
PROMPTS = 8          # prompts a family's token columns count over (random tokens, seeds 1..PROMPTS)
PEER = "fp8_e4m3"    # the peer cache in the same run: vLLM's --kv-cache-dtype fp8 (e4m3, scale 1.0), 8 bits a value


def _layer_types(cache) -> str:
    """"3 sliding (256) + 1 full" from a cache's specs."""
    from collections import Counter

    names = {"full": "full", "sliding": "sliding", "chunked": "chunked", "state": "linear", "unsupported": "kept"}
    c = Counter((s.kind, s.window, s.latent, s.type if s.kind == "unsupported" else "") for s in cache.specs)
    parts = []
    for (kind, window, latent, t), n in c.items():
        label = names[kind] + (" MLA" if latent else "") + (f" ({window})" if window else "") + (f" {t}" if t else "")
        parts.append(f"{n} {label}")
    return " + ".join(parts)


def _packs(cache) -> str:
    kinds = {s.kind for s in cache.specs}
    out = []
    if kinds & {"full", "sliding", "chunked"}:
        out.append("KV of " + "/".join(k for k in ("full", "sliding", "chunked") if k in kinds) + " layers")
    if "state" in kinds:
        out.append("linear layers' states kept (transformers' class)")
    if "unsupported" in kinds:
        out.append("compressed layers kept (unsupported='keep')")
    if any(s.latent for s in cache.specs):   # (its codecs: what KvcxCache._layer gives an MLA layer)
        from kvcx.cache.layer_config import latent_rope_codec

        out = [f"MLA latent ({cache.kv_config.key.describe()}) + RoPE key "
               f"({latent_rope_codec(cache.kv_config, cache.residual_length).describe()})"]
    return "; ".join(out)


def layer_shares(model, ids, mask, steps: int, ref_tokens, ref_logits, opts: dict) -> list:
    """Where the default scheme's error enters: for each packed layer, the KL of the teacher-forced run with only
    that layer on the default scheme (every other packed layer on 8-bit codes), and the residual stream entering it
    against what its attention adds (bench.families.attention_branch)."""
    from kvcx.cache import KvcxCache
    from kvcx.codecs import KVConfig

    base = KVConfig.from_scheme("kvcx")
    specs = KvcxCache(model.config, **opts).specs
    packed = [i for i, s in enumerate(specs) if s.packed]
    model.set_attn_implementation("eager")
    branch = attention_branch(model, ids, mask)
    model.set_attn_implementation("kvcx")
    out = []
    for i in packed:
        kv = KVConfig(key=base.key, value=base.value, scheme=base.scheme,
                      layer_bits=tuple((j, 8, 8) for j in packed if j != i))
        _, logits = decode(model, KvcxCache(model.config, kv_config=kv, **opts), ids, mask, steps, forced=ref_tokens)
        out.append(dict(layer=i, kind=specs[i].kind, kl=kl(ref_logits, logits), **branch.get(i, {})))
    return out


def run_family(name: str, cfg_fn, window: int, steps: int, tempered: bool = True, keep: bool = False,
               n_prompts: int = PROMPTS) -> dict:
    import torch
    from transformers import DynamicCache

    from kvcx.cache import KvcxCache
    from kvcx.cache.kvcx_cache import dynamic_cache_bytes

    prompt = 8 * window
    opts = {"unsupported": "keep"} if keep else {}
    cfg = cfg_fn()
    cfg.eos_token_id = None
    model = build(cfg)
    if tempered:
        temper(model, name)
    t = time.perf_counter()
    tally = dict(greedy=0, forced=0, greedy8=0, peer=0, bf_greedy=0, bf_forced=0)
    kls, peer_kls, leads, refs = [], [], [], []
    rep = first = None
    for seed in range(1, n_prompts + 1):   # prompt 1 is the one the memory, fused counts and layer shares read
        ids, mask = prompts(1, prompt, seed=seed)
        model.set_attn_implementation("eager")
        ref_tokens, ref_logits = decode(model, DynamicCache(config=model.config), ids, mask, steps)
        model.set_attn_implementation("kvcx")
        free, _ = decode(model, KvcxCache(model.config, **opts), ids, mask, steps)
        free8, _ = decode(model, KvcxCache(model.config, bits=8, **opts), ids, mask, steps)
        peer, _ = decode(model, KvcxCache(model.config, scheme=PEER, **opts), ids, mask, steps)
        _, peer_logits = decode(model, KvcxCache(model.config, scheme=PEER, **opts), ids, mask, steps,
                                forced=ref_tokens)
        cache = KvcxCache(model.config, **opts)
        _, logits = decode(model, cache, ids, mask, steps, forced=ref_tokens)
        top2 = torch.softmax(ref_logits, -1).topk(2, -1).values
        leads.append(top2[..., 0] - top2[..., 1])
        tally["greedy"] += int((free == ref_tokens).sum())
        tally["forced"] += int((logits.argmax(-1) == ref_tokens).sum())
        tally["greedy8"] += int((free8 == ref_tokens).sum())
        tally["peer"] += int((peer == ref_tokens).sum())
        kls.append(kl(ref_logits, logits))
        peer_kls.append(kl(ref_logits, peer_logits))
        refs.append((ids, mask, ref_tokens))
        if first is None:
            rep, first = cache.memory_report(), (ids, mask, ref_tokens, ref_logits)
    packed = [s for s in cache.specs if s.packed]
    shared = getattr(model.config.get_text_config(), "num_kv_shared_layers", 0) or 0   # KV-shared layers attend too
    decode_steps = (steps - 1) * (len(packed) + shared)
    why = sorted({r["fused_unsupported"] for r in rep["layers"] if r.get("fused_unsupported")})
    absorbed = sum(r.get("steps", {}).get("absorbed", 0) for r in rep["layers"])   # MLA: over the latent
    row = dict(name=name, types=_layer_types(cache), packs=_packs(cache), fused=rep["attention_steps"]["fused"],
               absorbed=absorbed,
               decode_steps=decode_steps, why=why, tokens=n_prompts * steps, kl=sum(kls) / len(kls),
               peer_kl=sum(peer_kls) / len(peer_kls), lead=float(torch.cat(leads).median()),
               mixed=any(s.kind in ("sliding", "chunked") for s in cache.specs))
    if tally["greedy"] < TARGET_TOKENS * row["tokens"]:   # below the target: which layer's codes move the distribution
        ids, mask, ref_tokens, ref_logits = first
        row["layers"] = layer_shares(model, ids, mask, steps, ref_tokens, ref_logits, opts)
    # the model in BF16: its tokens against the FP32 reference's, and the memory (both caches in BF16)
    bf = model.to(torch.bfloat16)
    bf.set_attn_implementation("eager")
    for i, (ids, mask, ref_tokens) in enumerate(refs):
        dyn = DynamicCache(config=bf.config)
        bf_tokens, _ = decode(bf, dyn, ids, mask, steps)
        _, bf_logits = decode(bf, DynamicCache(config=bf.config), ids, mask, steps, forced=ref_tokens)
        tally["bf_greedy"] += int((bf_tokens == ref_tokens).sum())
        tally["bf_forced"] += int((bf_logits.argmax(-1) == ref_tokens).sum())
        if i == 0:
            dynamic_bytes = dynamic_cache_bytes(dyn)
            bf.set_attn_implementation("kvcx")
            kc = KvcxCache(bf.config, **opts)
            decode(bf, kc, ids, mask, steps)
            held = kc.memory_report()
            bf.set_attn_implementation("eager")
    row.update(tally, kvcx_bytes=held["total_bytes"], dynamic_bytes=dynamic_bytes,
               windows=[r["tokens_held"] for r, s in zip(held["layers"], kc.specs) if s.window],
               seconds=time.perf_counter() - t)
    return row


def run_trained(name: str, cfg_fn, window: int, steps: int, keep: bool, n_prompts: int, train_steps: int,
                text) -> dict:
    """The family's model trained ``train_steps`` steps on the text's bytes (bench.families.train), then on
    ``n_prompts`` held-out prompts of 8x the window: the greedy tokens of each cache against DynamicCache's (FP32, the
    model's eager attention), and, fed the text's own next bytes (teacher-forced on the text, which a greedy loop
    cannot inflate), the top-1 equal to the reference's and the KL."""
    import torch
    from transformers import DynamicCache

    from kvcx.cache import KvcxCache

    train_text, held = text
    opts = {"unsupported": "keep"} if keep else {}
    cfg = cfg_fn()
    cfg.eos_token_id = None
    model = temper(build(cfg), name)
    t = time.perf_counter()
    losses = train(model, train_text, train_steps)
    trained_s = time.perf_counter() - t
    tally = dict(greedy=0, greedy8=0, peer=0, bf_greedy=0, text_top1=0, peer_text_top1=0)
    kls, peer_kls, leads, refs, sample, per_prompt = [], [], [], [], None, []
    caches = {"greedy": {}, "greedy8": {"bits": 8}, "peer": {"scheme": PEER}}
    items = text_prompts(held, 8 * window, steps, n_prompts)
    for ids, mask, nxt in items:
        model.set_attn_implementation("eager")
        ref, ref_logits = decode(model, DynamicCache(config=model.config), ids, mask, steps)
        _, ref_text = decode(model, DynamicCache(config=model.config), ids, mask, steps, forced=nxt)
        top2 = torch.softmax(ref_logits, -1).topk(2, -1).values
        leads.append(top2[..., 0] - top2[..., 1])
        refs.append(ref)
        if sample is None:
            first_text = ref_text
            sample = (bytes(ids[0, -24:].tolist()), bytes(ref[0].tolist()))
        model.set_attn_implementation("kvcx")
        for col, kw in caches.items():
            free, _ = decode(model, KvcxCache(model.config, **kw, **opts), ids, mask, steps)
            hits = int((free == ref).sum())
            tally[col] += hits
            if col == "greedy":
                per_prompt.append(hits)
        for col, kw, out in (("text_top1", {}, kls), ("peer_text_top1", {"scheme": PEER}, peer_kls)):
            _, logits = decode(model, KvcxCache(model.config, **kw, **opts), ids, mask, steps, forced=nxt)
            tally[col] += int((logits.argmax(-1) == ref_text.argmax(-1)).sum())
            out.append(kl(ref_text, logits))
    shares = None
    if tally["greedy"] < TARGET_TOKENS * n_prompts * steps:   # below the target: which layer's codes move it
        ids, mask, nxt = items[0]
        shares = layer_shares(model, ids, mask, steps, nxt, first_text, opts)
    bf = model.to(torch.bfloat16)   # what the deployment dtype alone keeps, against the FP32 reference's tokens
    bf.set_attn_implementation("eager")
    for (ids, mask, _), ref in zip(items, refs):
        bf_tokens, _ = decode(bf, DynamicCache(config=bf.config), ids, mask, steps)
        tally["bf_greedy"] += int((bf_tokens == ref).sum())
    return dict(name=name, tokens=n_prompts * steps, loss0=losses[0], loss=sum(losses[-10:]) / len(losses[-10:]),
                trained_s=trained_s, kl=sum(kls) / len(kls), peer_kl=sum(peer_kls) / len(peer_kls),
                lead=float(torch.cat(leads).median()), sample=sample, seconds=time.perf_counter() - t, layers=shares,
                interval=prompt_interval(per_prompt, steps), **tally)


def prompt_interval(counts: list, steps: int, resamples: int = 10000, seed: int = 0) -> tuple:
    """The 95 % interval of a greedy share over prompts (a percentile bootstrap, seeded): ``counts`` holds each
    prompt's tokens equal to the reference's (of ``steps``). A prompt that leaves the reference early costs the rest
    of its tokens, so the prompts, not the tokens, are the independent draws."""
    import random

    rng, n = random.Random(seed), len(counts)
    shares = sorted(sum(rng.choices(counts, k=n)) / (n * steps) for _ in range(resamples))
    return shares[int(0.025 * (resamples - 1))], shares[int(0.975 * (resamples - 1))]


def shares_section(out, rows: list, forced: str) -> None:
    """The section on where the default scheme's error enters (``rows``: those below the greedy target, each with
    layer_shares' list), each layer alone teacher-forced on ``forced``."""
    if not rows:
        return
    out("\n## Where the default scheme's error enters, in the rows below the greedy target\n")
    out(f"Each packed layer alone on the default scheme, every other packed layer on 8-bit codes (teacher-forced on "
        f"{forced}); beside it, over that prompt's last 64 tokens in FP32, the rms of the residual stream entering "
        "the layer and of what its attention adds to it (Gemma: its post_attention_layernorm's output).\n")
    out("| family | layer | type | KL (nats), this layer alone at the default scheme | residual entering (rms) "
        "| its attention adds (rms) |")
    out("|---|---:|---|---:|---:|---:|")
    for r in rows:
        for x in r["layers"]:
            out(f"| {r['name']} | {x['layer']} | {x['kind']} | {x['kl']:.6f} | {x.get('residual', float('nan')):.3f} "
                f"| {x.get('branch', float('nan')):.3f} |")
    out("")
    for r in rows:
        top = max(r["layers"], key=lambda x: x["kl"])
        total = sum(x["kl"] for x in r["layers"])
        out(f"{r['name']}: layer {top['layer']} ({top['kind']}) alone gives {top['kl']:.6f} nats of the "
            f"{total:.6f} the layers give one at a time ({top['kl'] / total:.0%}); its attention adds "
            f"{top.get('branch', float('nan')):.3f} rms to a residual stream of {top.get('residual', float('nan')):.3f}.")


def greedy_verdict(rows: list, total: int) -> str:
    """The sentence on the greedy target: the rows the default scheme meets it in, those below it, and how many
    rows the other caches of the table meet it in."""
    def meets(col):
        return sum(r[col] >= TARGET_TOKENS * total for r in rows)

    low = [r for r in rows if r["greedy"] < TARGET_TOKENS * total]
    below = ", ".join(f"{r['name']} {r['greedy'] / total:.1%}" + (
        f" ({r['interval'][0]:.1%}-{r['interval'][1]:.1%})" if "interval" in r else "") for r in low)
    brackets = " (in brackets: the 95 % interval over prompts, a bootstrap)" if any("interval" in r for r in low) else ""
    return (f"Greedy tokens equal to DynamicCache's, target >= {TARGET_TOKENS:.0%} on the default scheme: met by "
            f"{len(rows) - len(low)} of {len(rows)} rows" + (f"; below it{brackets}: {below}" if low else "") + ". The same "
            f"target, the other caches of the table: 8-bit codes meet it in {meets('greedy8')} of {len(rows)} rows, "
            f"{PEER} in {meets('peer')}, the model in BF16 in {meets('bf_greedy')}.")


def trained_page(args, runs, text) -> None:
    """The page of --train-steps: every family trained on the text's bytes, then its caches' tokens."""
    out = Report()
    rows = []
    for name, fn, _, keep in runs:
        row = run_trained(name, fn, args.window, args.steps, keep, args.prompts, args.train_steps, text)
        rows.append(row)
        print(f"  {name}: trained {row['trained_s']:.0f} s, {row['seconds']:.0f} s in all", flush=True)
    n, k = args.steps, args.prompts
    total = n * k

    def share(r, col):
        return f"{r[col] / total:.1%} ({r[col]})"

    def sample(r):
        def show(b):
            return "".join(chr(c) if 32 <= c < 127 and chr(c) not in "|`\\" else "·" for c in b)
        return f"`{show(r['sample'][0])}` -> `{show(r['sample'][1])}`"

    out(f"## Every family trained {args.train_steps} steps, batch 1: {k} held-out prompts of {8 * args.window} bytes "
        f"(8x a {args.window}-byte window), each then {n} greedy tokens\n")
    out(f"Token columns: the share of the {total} tokens ({k} prompts x {n}) equal to DynamicCache's. Greedy: free "
        "running, each cache on its own tokens. Fed the text: each cache fed the text's own next bytes (teacher-forced "
        "on the text, where a greedy loop cannot inflate the count), its top-1 against the reference's, and the KL.\n")
    out("| family | training loss, first step -> last 10 (nats a byte) | greedy, default scheme "
        f"| greedy, 8-bit codes | greedy, {PEER} (vLLM) | greedy, the model in BF16 | fed the text: top-1, default "
        f"| KL (nats), default | fed the text: top-1, {PEER} | KL (nats), {PEER} "
        "| the reference's median top-1 lead (probability) | greedy, default scheme: 95 % interval over prompts "
        "| the first prompt's last 24 bytes, then the reference's greedy bytes |")
    out("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        out(f"| {r['name']} | {r['loss0']:.2f} -> {r['loss']:.2f} | {share(r, 'greedy')} | {share(r, 'greedy8')} "
            f"| {share(r, 'peer')} | {share(r, 'bf_greedy')} | {share(r, 'text_top1')} | {r['kl']:.6f} "
            f"| {share(r, 'peer_text_top1')} | {r['peer_kl']:.6f} | {r['lead']:.4f} "
            f"| {r['interval'][0]:.1%}-{r['interval'][1]:.1%} | {sample(r)} |")

    out("\n" + greedy_verdict(rows, total) + " Fed the text, the default scheme's "
        f"top-1 equals the reference's on {sum(r['text_top1'] for r in rows) / (total * len(rows)):.1%} of the "
        f"tokens of every row together ({PEER}: {sum(r['peer_text_top1'] for r in rows) / (total * len(rows)):.1%}).")
    shares_section(out, [r for r in rows if r.get("layers")], "the first prompt's text")
    if args.markdown:
        trained = sum(r["trained_s"] for r in rows) / len(rows)
        out.write(args.markdown, "# Model families, trained: KvcxCache's tokens on models with confident next tokens\n\n"
                  "The tiny models of [model families](families.md) (bench/families.py: 4 layers, 4 query heads over "
                  "2 KV heads of 64 channels, a vocabulary of 256: bytes), each trained as a byte-level language "
                  f"model for {args.train_steps} AdamW steps of 16 windows of 256 bytes on the first "
                  f"{TRAIN_SHARE:.0%} of {args.text.name} (bench.families.train, seeded; {trained:.0f} s a family "
                  "on this machine), then prompted with the held-out rest. A random model's next-token distribution "
                  "is flat (families.md: its top-1 leads the second by a fraction of a percent of probability), so "
                  "that a near-tie any rounding flips changes every later token; trained, the top-1 leads by the "
                  "lead column's figure and the attention has something to attend to. Still tiny and briefly "
                  "trained: a weak model that falls into loops (the last column), so beside the greedy columns the "
                  "caches are also fed the text. They measure the cache on each family's layer kinds, not the "
                  "family's quality (quality: the embedded model, [quality](quality.md)). KvcxCache's default scheme "
                  "(`kvcx`), residual 64, the `kvcx` attention; the reference DynamicCache(config=...) with the "
                  "model's eager attention, in FP32.")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--window", type=int, default=256, help="the sliding window / chunk in tokens (prompt: 8x)")
    ap.add_argument("--steps", type=int, default=16, help="greedy tokens after the prompt")
    ap.add_argument("--prompts", type=int, default=PROMPTS,
                    help="prompts (random tokens, seeds 1..N) the token columns count over")
    ap.add_argument("--families", nargs="*", default=None, help="only these (substrings of the names)")
    ap.add_argument("--markdown", type=Path, default=None, help="also write the tables to this file")
    ap.add_argument("--train-steps", type=int, default=0,
                    help="train each family's model this many steps on the text's bytes first (0: random weights); "
                         "prompts then come from the held-out text")
    ap.add_argument("--text", type=Path, default=DEFAULT_TEXT,
                    help=f"the text --train-steps trains on (its first {TRAIN_SHARE:.0%}) and prompts from")
    args = ap.parse_args(argv)
    if args.window < 16 or args.steps < 2 or args.prompts < 1 or args.train_steps < 0:
        ap.error(f"--window {args.window} / --steps {args.steps} / --prompts {args.prompts} / --train-steps "
                 f"{args.train_steps}: a window of 16 tokens or more (the prompt is 8 of them), 2 steps or more, 1 "
                 "prompt or more and 0 training steps or more")
    text = None
    if args.train_steps:
        if not args.text.is_file():
            ap.error(f"--text {args.text}: no such file; pass WikiText-2's wiki.test.raw (or any text of 1 KiB or "
                     "more)")
        try:   # the text's and the prompts' own checks, before any family trains
            text = text_bytes(args.text)
            text_prompts(text[1], 8 * args.window, args.steps, args.prompts)
        except ValueError as e:
            ap.error(f"--text {args.text} / --prompts {args.prompts}: {e}")
    out = Report()
    fams = list(family_configs(args.window, 8 * args.window).items())
    runs = [(n, f, True, False) for n, f in fams]
    if not args.train_steps:   # (training sets q_norm's scale: the untempered row is the random model's)
        runs.insert([n for n, _ in fams].index("GPT-OSS"), ("Gemma 4 (random q_norm)", fams[
            [n for n, _ in fams].index("Gemma 4")][1], False, False))
    runs.append(("DeepSeek V4 (compressed layers kept)",
                 lambda: unsupported_config(args.window, 8 * args.window), True, True))
    if args.families:
        runs = [r for r in runs if any(f.lower() in r[0].lower() for f in args.families)]
        if not runs:
            ap.error(f"--families {' '.join(args.families)}: no family's name holds these; the families: "
                     + ", ".join(n for n, _ in fams))
    if args.train_steps:
        return trained_page(args, runs, text)
    rows = []
    for name, fn, tempered, keep in runs:
        row = run_family(name.replace(" (random q_norm)", ""), fn, args.window, args.steps, tempered, keep,
                         args.prompts)
        row["name"] = name
        rows.append(row)
        print(f"  {name}: {row['seconds']:.1f} s", flush=True)
    n, k = args.steps, args.prompts
    total = n * k

    def share(r, col):
        return f"{r[col] / total:.1%} ({r[col]})"

    out(f"## Every family, batch 1: {k} prompts of {8 * args.window} tokens (8x a {args.window}-token window), "
        f"each then {n} greedy tokens\n")
    out(f"Token columns: the share of the {total} tokens ({k} prompts x {n}) equal to DynamicCache's. Greedy: free "
        "running, each cache on its own tokens; teacher-forced: the top-1 fed DynamicCache's tokens. Memory and the "
        "fused steps: the first prompt.\n")
    out("| family | layer types | what kvcx packs | decode steps fused (CPU) | memory vs DynamicCache (BF16) "
        "| greedy, default scheme | teacher-forced top-1, default | KL (nats), default "
        f"| greedy, 8-bit codes | greedy, {PEER} (vLLM) | KL (nats), {PEER} "
        "| greedy / teacher-forced, DynamicCache in BF16 | the reference's median top-1 lead (probability) |")
    out("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        fused = f"{r['fused']} / {r['decode_steps']}" + (
            f" (MLA: the latent decoded, {r['absorbed']} attended with kv_b_proj absorbed)" if r["absorbed"] else
            " (materialised: MLA)" if r["fused"] == 0 and r["why"] else "")
        out(f"| {r['name']} | {r['types']} | {r['packs']} | {fused} | {r['kvcx_bytes'] / r['dynamic_bytes']:.3f}x "
            f"| {share(r, 'greedy')} | {share(r, 'forced')} | {r['kl']:.6f} | {share(r, 'greedy8')} "
            f"| {share(r, 'peer')} | {r['peer_kl']:.6f} | {share(r, 'bf_greedy')} / {share(r, 'bf_forced')} "
            f"| {r['lead']:.4f} |")
    mixed = [r for r in rows if r["mixed"] and "kept" not in r["name"]]
    worst = max(mixed, key=lambda r: r["kvcx_bytes"] / r["dynamic_bytes"]) if mixed else None
    out("")
    if worst is not None:
        ratio = worst["kvcx_bytes"] / worst["dynamic_bytes"]
        out(f"Memory, the families with sliding or chunked layers (3 : 1 full): at most {ratio:.3f}x DynamicCache's "
            f"bytes ({worst['name']}); target <= {TARGET_MEMORY}x: {'met' if ratio <= TARGET_MEMORY else 'missed'}. "
            f"Tokens a windowed layer holds after the prompt and {n} tokens: at most "
            f"{max(max(r['windows']) for r in mixed)} (window {args.window}, a packed chunk of 64 and the residual).")

    low = [r for r in rows if r["greedy"] < TARGET_TOKENS * total]
    out("\n" + greedy_verdict(rows, total) + " A random "
        "model's next-token distribution is flat (its top-1 leads the second by a fraction of a percent of "
        "probability): free running, one near-tie any cache's rounding flips changes every later token, so the "
        "greedy share measures the model's ties as much as the cache; the teacher-forced column and the KL say how "
        "far the distributions are.")
    shares_section(out, [r for r in low if r.get("layers")], "the first prompt's reference tokens")
    reasons = sorted({w for r in rows for w in r["why"]})
    if reasons:
        out("\nWhy steps materialise where they do: " + "; ".join(reasons) + ".")
    if args.markdown:
        out.write(args.markdown, "# Model families: KvcxCache on the layer kinds of 2026's open models\n\n"
                  "Tiny random-weight models built from transformers' own config classes (bench/families.py: 4 "
                  "layers, 4 query heads over 2 KV heads of 64 channels; Gemma 4's global layers 1 KV head of 128). "
                  "They prove code paths and memory, not quality: quality is measured on the embedded model "
                  "([quality](quality.md)). KvcxCache's default scheme (`kvcx`), residual 64; the reference is "
                  "DynamicCache(config=...) with the model's eager attention, in FP32. Beside the default scheme's "
                  "columns: KvcxCache with 8-bit codes (the code path without the 4-bit error), vLLM's FP8 cache "
                  f"({PEER}, emulated byte-exact: a peer in the same run), the same model in BF16 with "
                  "DynamicCache against the FP32 reference (what the model's deployment dtype alone keeps), and how "
                  "far the reference's top-1 leads its second token. Gemma 4 attends with scaling 1.0: its "
                  "rows are built with q_norm at head_dim^-0.5 (a trained model's temperature; the row marked "
                  "'random q_norm' keeps the random init, a hard argmax over scores of deviation sqrt(head_dim)).")


if __name__ == "__main__":
    main()
