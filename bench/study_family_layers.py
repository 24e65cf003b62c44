"""The trained family models below the greedy target (docs/results/families-trained.md), each with the one layer
that page's layer table names (the largest KL alone at the default scheme) on 8-bit codes and the others on the
default: does one sensitive layer hold the shortfall? (What a per-layer plan, ``kvcx calibrate``, would spend bits
on; here the layer is the page's, not a calibration's.) And what the misses are made of: where each prompt's greedy
tokens first leave the reference's, the reference's top-1 lead (probability) at that step, beside the same for the
model in BF16; every layer's keys alone on 8-bit codes, then its values alone (greedy and, fed the text, KL): which
half of the default's codes the shortfall comes from; in mixture-of-experts rows, the steps where a router picks other
experts with the default scheme's cache than with the reference's, and the share of the KL they hold; beside the
default, the peer a transformers user reaches for, transformers' own QuantizedCache (quanto int4, groups of 64), on
the same prompts where it takes the family (it refuses sliding layers: then its message).

    python -m bench.study_family_layers [--page docs/results/families-trained.md] [--markdown docs/results/families-layer-plan.md]
        [--other-machine docs/results/history/families-trained-avx512.md]

``--other-machine``: a trained page the same command wrote on another machine; a section sets its greedy columns
beside the page's, every family (the same seeds, steps, text and prompts; the training's float rounding differs with
the CPU's instruction set, so the weights do).

The models are trained as the page's were (bench.families.train, the same seed and steps: the page's title), and
prompted with the same held-out windows (as many as the page's title names), 16 greedy tokens each, against
DynamicCache (FP32, eager attention).
"""
from __future__ import annotations

import argparse
import re
import time
from pathlib import Path

from bench.bench_families import TARGET_TOKENS
from bench.families import (DEFAULT_TEXT, build, decode, family_configs, kl, step_kl, temper, text_bytes, text_prompts,
                            train)
from bench.report import Report

PAGE = Path(__file__).resolve().parents[1] / "docs/results/families-trained.md"


def sensitive_layers(page: Path) -> tuple:
    """(train steps, window, prompts, {family: (layer, its KL alone)}) from the page's title and layer table."""
    text = page.read_text()
    title = re.search(r"trained (\d+) steps, batch 1: (\d+) held-out prompts of \d+ bytes \(8x a (\d+)-byte window\)",
                      text)
    if title is None or "error enters" not in text:
        raise SystemExit(f"{page}: no trained families table with a layer table; run bench.bench_families "
                         "--train-steps N --markdown on it first")
    worst = {}
    for line in text.split("error enters", 1)[1].splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 6 and cells[1].isdigit():
            kl = float(cells[3])
            if cells[0] not in worst or kl > worst[cells[0]][1]:
                worst[cells[0]] = (int(cells[1]), kl)
    return int(title.group(1)), int(title.group(3)), int(title.group(2)), worst


def first_divergence(tokens, ref, ref_logits):
    """(the step at which ``tokens`` [1, steps] first differs from the reference's greedy ``ref``, the reference's
    top-1 lead in probability at that step), or None where every token is the reference's."""
    import torch

    diff = (tokens[0] != ref[0]).nonzero()
    if not len(diff):
        return None
    step = int(diff[0])
    top2 = torch.softmax(ref_logits[0, step], -1).topk(2).values
    return step, float(top2[0] - top2[1])


def with_bits(kv, kind: str, bits: int):
    """``kv`` with its ``kind`` ("key" or "value") codec at ``bits`` bits (the same layout), the other as it is."""
    from kvcx.codecs import IntCodec, KVConfig

    codecs = {"key": kv.key, "value": kv.value}
    codecs[kind] = IntCodec.from_config({**codecs[kind].get_config(), "bits": bits})
    return KVConfig(key=codecs["key"], value=codecs["value"], scheme=f"{kv.scheme}, {kind}s {bits}-bit")


class RouteRecorder:
    """The experts a mixture-of-experts model's routers pick for each forward's last token: a context manager that
    hooks every router (a module with an integer ``top_k`` whose class name says Router) and appends, per forward,
    one tuple of each router's picked experts (a frozenset a router); :attr:`routers` 0 for a dense model."""

    def __init__(self, model):
        self.forwards, self._hooks, self._step = [], [], []
        self._mods = [m for m in model.modules() if "router" in type(m).__name__.lower()
                      and isinstance(getattr(m, "top_k", None), int)]
        self.routers = len(self._mods)

    def _hook(self, mod, inp, out):
        import torch

        outs = out if isinstance(out, tuple) else (out,)
        picked = [t for t in outs if isinstance(t, torch.Tensor) and not t.is_floating_point()]
        rows = picked[-1] if picked else outs[0].topk(mod.top_k, -1).indices   # indices, else the logits' top-k
        self._step.append(frozenset(rows.reshape(-1, rows.shape[-1])[-1].tolist()))
        if len(self._step) == self.routers:
            self.forwards.append(tuple(self._step))
            self._step = []

    def __enter__(self):
        self._hooks = [m.register_forward_hook(self._hook) for m in self._mods]
        return self

    def __exit__(self, *exc):
        for h in self._hooks:
            h.remove()
        return False


QUANTO = "QuantizedCache (quanto int4 g64, residual 64)"


def quanto_cache(model):
    """A factory of transformers' QuantizedCache for ``model`` (optimum-quanto's int4 codes in groups of 64, a scale
    and a shift each: 4.5 bits a value counted in FP16 as a GPU holds them; a residual of 64 full-precision tokens,
    KvcxCache's), or, where there is none, the reason (a string): optimum-quanto missing, or transformers' own
    refusal (QuantizedCache takes full-attention models only)."""
    try:
        import optimum.quanto  # noqa: F401
        from transformers import QuantizedCache
    except ImportError:
        return "optimum-quanto not installed (pip install kvcx[peers])"

    def make():
        return QuantizedCache("quanto", model.config, nbits=4, q_group_size=64, residual_length=64)

    try:
        make()
    except ValueError as e:
        return f"refused: {str(e).splitlines()[0]}"
    return make


def _mean(xs) -> float:
    return sum(xs) / len(xs)


def _leads(divs: list) -> str:
    return ", ".join(f"{lead:.4f}" for _, lead in sorted(d for d in divs if d is not None)) or "-"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--page", type=Path, default=PAGE, help="the trained families page to read the layers from")
    ap.add_argument("--text", type=Path, default=DEFAULT_TEXT, help="the text the page's models trained on")
    ap.add_argument("--steps", type=int, default=16, help="greedy tokens after each prompt")
    ap.add_argument("--markdown", type=Path, default=None, help="also write the table to this file")
    ap.add_argument("--other-machine", type=Path, default=None,
                    help="a trained families page written on another machine, set beside --page's")
    args = ap.parse_args(argv)
    if args.other_machine is not None and not args.other_machine.is_file():
        ap.error(f"--other-machine {args.other_machine}: no such file; give a page bench.bench_families "
                 "--train-steps N --markdown wrote")
    if not args.page.is_file() or not args.text.is_file() or args.steps < 1:
        ap.error(f"--page {args.page} / --text {args.text} / --steps {args.steps}: both files are needed, and 1 "
                 "greedy token or more")
    if args.other_machine is not None:
        trained_table(args.other_machine)   # its table and Machine line, or one line, before any model trains
    train_steps, window, n_prompts, worst = sensitive_layers(args.page)
    try:   # the text's and the prompts' own checks, before any model trains
        head, held = text_bytes(args.text)
        text_prompts(held, 8 * window, args.steps, n_prompts)
    except ValueError as e:
        ap.error(f"--text {args.text}: {e}")
    unknown = sorted(set(worst) - set(family_configs()))
    if unknown:
        ap.error(f"--page {args.page}: its layer table names {', '.join(unknown)}, not a family of "
                 "bench.families.family_configs; write the page with bench.bench_families --train-steps N")
    from transformers import DynamicCache

    from kvcx.cache import KvcxCache
    from kvcx.codecs import KVConfig

    import torch

    configs = family_configs(window, 8 * window)
    base = KVConfig.from_scheme("kvcx")
    halves = {"keys": with_bits(base, "key", 8), "values": with_bits(base, "value", 8)}
    total = n_prompts * args.steps
    out, rows, parts = Report(), [], []
    for name, (layer, layer_kl) in worst.items():
        t = time.perf_counter()
        cfg = configs[name]()
        cfg.eos_token_id = None
        model = temper(build(cfg), name)
        train(model, head, train_steps)
        kv = KVConfig(key=base.key, value=base.value, scheme=base.scheme, layer_bits=((layer, 8, 8),))
        default = promoted = 0
        part = dict(name=name, divs=[], bf_divs=[], kl=[], routes=[], **{h: 0 for h in halves},
                    **{h + "_kl": [] for h in halves})
        peer = quanto_cache(model)
        part.update(quanto=0, quanto_kl=[], quanto_why=peer if isinstance(peer, str) else "")
        items, refs = text_prompts(held, 8 * window, args.steps, n_prompts), []
        for ids, mask, nxt in items:
            model.set_attn_implementation("eager")
            ref, ref_logits = decode(model, DynamicCache(config=model.config), ids, mask, args.steps)
            refs.append((ref, ref_logits))
            with RouteRecorder(model) as ref_routes:
                _, ref_text = decode(model, DynamicCache(config=model.config), ids, mask, args.steps, forced=nxt)
            if callable(peer):   # the peer on the reference's own attention (eager), as a transformers user runs it
                part["quanto"] += int((decode(model, peer(), ids, mask, args.steps)[0] == ref).sum())
                part["quanto_kl"].append(kl(ref_text, decode(model, peer(), ids, mask, args.steps, forced=nxt)[1]))
            model.set_attn_implementation("kvcx")
            tokens = decode(model, KvcxCache(model.config), ids, mask, args.steps)[0]
            default += int((tokens == ref).sum())
            part["divs"].append(first_divergence(tokens, ref, ref_logits))
            with RouteRecorder(model) as routes:
                text_logits = decode(model, KvcxCache(model.config), ids, mask, args.steps, forced=nxt)[1]
            part["kl"].append(kl(ref_text, text_logits))
            if routes.routers:   # each step after the prompt: whether any router picked other experts, and its KL
                part["routes"] += [(a != b, x) for a, b, x in zip(ref_routes.forwards[1:], routes.forwards[1:],
                                                                 step_kl(ref_text, text_logits)[0, 1:].tolist())]
            promoted += int((decode(model, KvcxCache(model.config, kv_config=kv), ids, mask, args.steps)[0]
                             == ref).sum())
            for half, hkv in halves.items():
                part[half] += int((decode(model, KvcxCache(model.config, kv_config=hkv), ids, mask, args.steps)[0]
                                   == ref).sum())
                part[half + "_kl"].append(kl(ref_text, decode(model, KvcxCache(model.config, kv_config=hkv), ids, mask,
                                                              args.steps, forced=nxt)[1]))
        model.to(torch.bfloat16)   # the model's own BF16 (eager, DynamicCache): where it leaves the reference
        model.set_attn_implementation("eager")
        for (ids, mask, _), (ref, ref_logits) in zip(items, refs):
            part["bf_divs"].append(first_divergence(decode(model, DynamicCache(config=model.config), ids, mask,
                                                           args.steps)[0], ref, ref_logits))
        model.to(torch.float32)
        specs = KvcxCache(model.config).specs
        n_packed = sum(s.packed for s in specs)
        part["latent"] = any(s.latent for s in specs)   # MLA: the cache's keys are the latent, its values the RoPE key
        part["default"] = default
        rows.append((name, layer, layer_kl, n_packed, default, promoted))
        parts.append(part)
        print(f"  {name}: {time.perf_counter() - t:.0f} s", flush=True)
    out(f"## The trained rows below the greedy target, one layer on 8-bit codes ({n_prompts} prompts x {args.steps} "
        f"greedy tokens = {total})\n")
    out("| family | the page's layer (its KL alone) | packed layers | greedy, default scheme "
        "| greedy, that layer on 8-bit codes | target >= 90 % |")
    out("|---|---:|---:|---:|---:|---|")
    for name, layer, layer_kl, n_packed, default, promoted in rows:
        out(f"| {name} | {layer} ({layer_kl:.6f}) | {n_packed} | {default / total:.1%} ({default}) "
            f"| {promoted / total:.1%} ({promoted}) | {'met' if promoted >= TARGET_TOKENS * total else 'missed'} |")
    met = sum(r[5] >= TARGET_TOKENS * total for r in rows)
    out(f"\nWith that one layer on 8-bit codes, {met} of {len(rows)} rows meet the target. One layer of these "
        "models' 4 is a quarter of the cache (about 5 bits a value on average); one layer of a 32-layer model "
        "would add 0.125 bits a value.")
    peer_section(out, parts, total)
    misses_section(out, parts, total)
    routing_section(out, parts)
    if args.other_machine is not None:
        machines_section(out, args.page, args.other_machine)
    if args.markdown:
        out.write(args.markdown, "# Model families, trained: one sensitive layer on 8-bit codes\n\n"
                  "The rows of [trained families](families-trained.md) below the greedy target, with the layer its "
                  "layer table names (the largest KL alone at the default scheme) on 8-bit codes and the others "
                  "on the default: how much of the shortfall one layer holds, what a per-layer plan "
                  "(`kvcx calibrate`) spends bits on. The layer is the page's, not a calibration's. Then what the "
                  "misses are made of: the reference's top-1 lead where each prompt's greedy tokens first leave "
                  "it (the default scheme beside the model's own BF16), which half of the default's codes, "
                  "keys or values, holds the KL, and in mixture-of-experts rows how much of it the steps hold "
                  "where a router picks other experts. Beside the default, transformers' own QuantizedCache on the "
                  "same prompts" + ("; and every family's greedy columns beside the same training run on another "
                                    "machine." if args.other_machine is not None else "."))


def peer_section(out, parts: list, total: int) -> None:
    """The rows beside transformers' own quantized cache on the same prompts (``parts``: a dict a row from main's
    loop, its ``quanto`` count and KLs, or ``quanto_why`` where the peer did not run)."""
    out("\n## Beside transformers' QuantizedCache\n")
    out(f"The same prompts with the peer a transformers user reaches for: {QUANTO} (optimum-quanto's asymmetric int4 "
        "codes in groups of 64 along the head dim, a scale and a shift each: 4.5 bits a value with them in FP16, "
        "against the default scheme's 4.43), on the reference's own eager attention. Greedy against DynamicCache's "
        "tokens; KL fed the text's own next bytes.\n")
    out(f"| family | greedy, default scheme | KL (nats), default | greedy, {QUANTO} | KL (nats), {QUANTO} |")
    out("|---|---:|---:|---:|---:|")
    for p in parts:
        peer = ((f"{p['quanto'] / total:.1%} ({p['quanto']})", f"{_mean(p['quanto_kl']):.6f}") if not p["quanto_why"]
                else (p["quanto_why"].replace("|", "/"), "-"))
        out(f"| {p['name']} | {p['default'] / total:.1%} ({p['default']}) | {_mean(p['kl']):.6f} | {peer[0]} "
            f"| {peer[1]} |")
    ran = [p for p in parts if not p["quanto_why"]]
    if ran:
        below = [p["name"] for p in ran if p["quanto"] < TARGET_TOKENS * total]
        out(f"\n{QUANTO} meets the greedy target in {len(ran) - len(below)} of the {len(ran)} rows it takes"
            + (f" (below it: {', '.join(below)})" if below else "") + "; its tokens equal DynamicCache's "
            + ("more" if sum(p["quanto"] for p in ran) > sum(p["default"] for p in ran) else "no more")
            + " often than the default scheme's in those rows together ("
            + f"{sum(p['quanto'] for p in ran)} against {sum(p['default'] for p in ran)} of {len(ran) * total}).")


def misses_section(out, parts: list, total: int) -> None:
    """The section on what the misses are made of (``parts``: a dict a row from main's loop)."""
    out("\n## What the misses are made of\n")
    out("Where each prompt's greedy tokens first leave the reference's, and the reference's top-1 lead (probability: "
        "its first token's minus its second's) at that step, for the default scheme and for the model in BF16 "
        "(eager, DynamicCache: no kvcx in it); then every packed layer's keys alone on 8-bit codes, the values on "
        "the default's, and the other way round: greedy tokens, and KL fed the text's own next bytes.\n")
    out("| family | prompts left, default | the reference's lead at each, default | prompts left, the model in BF16 "
        "| the reference's lead at each, BF16 | KL (nats), default | greedy, keys on 8-bit codes | KL | greedy, "
        "values on 8-bit codes | KL |")
    out("|---|---:|---|---:|---|---:|---:|---:|---:|---:|")
    for p in parts:
        left = sum(d is not None for d in p["divs"])
        bf_left = sum(d is not None for d in p["bf_divs"])
        out(f"| {p['name']} | {left} of {len(p['divs'])} | {_leads(p['divs'])} | {bf_left} of {len(p['bf_divs'])} "
            f"| {_leads(p['bf_divs'])} | {_mean(p['kl']):.6f} | {p['keys'] / total:.1%} ({p['keys']}) "
            f"| {_mean(p['keys_kl']):.6f} | {p['values'] / total:.1%} ({p['values']}) | {_mean(p['values_kl']):.6f} |")
    leads = sorted(d[1] for p in parts for d in p["divs"] if d is not None)
    bf_leads = sorted(d[1] for p in parts for d in p["bf_divs"] if d is not None)
    if leads:
        out(f"\nThe default scheme leaves the reference in {len(leads)} of {sum(len(p['divs']) for p in parts)} "
            f"prompts, at a step where the reference's top-1 led by {leads[0]:.4f} to {leads[-1]:.4f} of probability "
            f"(median {leads[len(leads) // 2]:.4f}); the model in BF16 leaves it in {len(bf_leads)}"
            + (f", at leads of {bf_leads[0]:.4f} to {bf_leads[-1]:.4f} (median {bf_leads[len(bf_leads) // 2]:.4f})"
               if bf_leads else "") + ".")
    latent = [p["name"] for p in parts if p.get("latent")]
    if latent:
        out(f"In {', '.join(latent)} transformers hands the MLA layer's cache the compressed latent as its keys and the "
            "shared RoPE key as its values: there the keys columns are the latent on 8-bit codes, the values columns "
            "the RoPE key on 8-bit codes.")
    halves = sorted(parts, key=lambda p: _mean(p["keys_kl"]) - _mean(p["values_kl"]))
    keys_first = [p["name"] for p in halves if _mean(p["keys_kl"]) < _mean(p["values_kl"])]
    values_first = [p["name"] for p in halves if _mean(p["keys_kl"]) > _mean(p["values_kl"])]
    out(("" if leads else "\n") + "Which half of the default's codes holds more of the KL: the keys (8-bit keys "
        "leave less KL than 8-bit values) in " + (", ".join(keys_first) or "no row") + "; the values in "
        + (", ".join(values_first) or "no row") + ".")


def routing_section(out, parts: list) -> None:
    """Mixture-of-experts rows: the teacher-forced steps where the default scheme's cache makes a router pick other
    experts than the reference's, and the share of the KL those steps hold."""
    moe = [p for p in parts if p["routes"]]
    if not moe:
        return
    out("\n## Mixture-of-experts rows: routing\n")
    out("Fed the text's own next bytes, each step after the prompt: whether any layer's router picks other experts "
        "for the token with the default scheme's cache than with the reference's, and the KL at those steps against "
        "the others'. A router's top-k is a discontinuity: a small change in the hidden state that flips it changes "
        "the layer's output by a whole expert.\n")
    out("| family | steps | steps a router picks other experts | mean KL there (nats) | mean KL elsewhere | their "
        "share of the KL |")
    out("|---|---:|---:|---:|---:|---:|")
    for p in moe:
        flip = [x for f, x in p["routes"] if f]
        same = [x for f, x in p["routes"] if not f]
        total = sum(flip) + sum(same)
        out(f"| {p['name']} | {len(p['routes'])} | {len(flip)} | "
            + (f"{sum(flip) / len(flip):.6f}" if flip else "-") + " | "
            + (f"{sum(same) / len(same):.6f}" if same else "-")
            + f" | {sum(flip) / total if total > 0 else 0.0:.0%} |")


def trained_table(page: Path) -> tuple:
    """(the Machine line, {family: its cells}) of a trained families page's main table (bench_families's columns:
    family, training loss, greedy default, 8-bit, fp8_e4m3, BF16, ...)."""
    from bench.publish import table

    machine = re.search(r"Machine: (.*?)\. Date", page.read_text())
    rows = {k: v for k, v in table(page, "Every family trained").items() if isinstance(k, str) and k != "family"}
    if machine is None or not rows:
        raise SystemExit(f"{page}: no trained families table with a Machine line; write it with bench.bench_families "
                         "--train-steps N --markdown")
    return machine.group(1), rows


def machines_section(out, page: Path, other: Path) -> None:
    """Every family's greedy columns on ``page`` beside ``other``'s, the same run written on another machine."""
    def share(cell):
        return float(cell.split("%")[0])

    here_m, here = trained_table(page)
    there_m, there = trained_table(other)
    both = [f for f in here if f in there]
    out("\n## The same seeded training on another machine\n")
    out(f"`{page.name}` (Machine: {here_m}) beside `{other.as_posix().split('docs/', 1)[-1]}`, the same command on "
        f"another machine (Machine: {there_m}): the same seeds, steps, text and prompts. The training's float "
        "rounding follows the CPU's instruction set (torch picks its kernels by it), so 200 steps end on other "
        "weights: another draw of each tiny model, not another cache. Greedy against DynamicCache's tokens; "
        "training loss: the mean of its last 10 steps (nats a byte).\n")
    out("| family | training loss, here | there | greedy, default scheme, here | there | greedy, 8-bit codes, here "
        "| there | greedy, the model in BF16, here | there |")
    out("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for f in both:
        a, b = here[f], there[f]
        out(f"| {f} | {a[1].split('-> ')[-1]} | {b[1].split('-> ')[-1]} | {a[2]} | {b[2]} | {a[3]} | {b[3]} "
            f"| {a[5]} | {b[5]} |")
    met = [f for f in both if share(here[f][2]) >= 100 * TARGET_TOKENS]
    met_there = [f for f in both if share(there[f][2]) >= 100 * TARGET_TOKENS]
    below_both = [f for f in both if f not in met and f not in met_there]
    moved = max(both, key=lambda f: abs(share(here[f][2]) - share(there[f][2])))
    out(f"\nThe default scheme meets the greedy target (>= 90 %) in {len(met)} of {len(both)} rows here and in "
        f"{len(met_there)} there; below it on both machines: {', '.join(below_both) or 'no row'}. The largest "
        f"move between the two draws: {moved}, {share(there[moved][2]):.1f} % there, {share(here[moved][2]):.1f} % "
        "here.")


if __name__ == "__main__":
    main()
