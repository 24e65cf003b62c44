"""``kvcx calibrate``: per-layer bit widths (or per-channel weights) under a budget, written as a plan."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, List, Optional

import typer
from rich.table import Table

from kvcx.cli.app import (FLAG, BitsOpt, DeviceOpt, GroupOpt, JsonOpt, KeysBeforeRopeOpt, ThreadsOpt, app,
                          check_files_first, cli_errors, kv_config_from)
from kvcx.cli.render import emit_json, out, print_phase, window_bar
from kvcx.errors import KvcxError
from kvcx.quality.calibrate import DEFAULT_OFFSET, DEFAULT_WINDOWS
from kvcx.quality.guard import PROTECT


@app.command()
def calibrate(
    out_path: Annotated[Path, typer.Option("--out", "-o", help="Plan file to write (JSON, atomically); pass it to "
                                                                "compress/metrics/validate --plan.")],
    budget: Annotated[Optional[float], typer.Option(help="Nominal bits per value to spend (codes, scales, zero "
                                                         "points).")] = None,
    scheme: Annotated[Optional[str], typer.Option("--scheme", help="Base scheme: kvcx3 (default when measuring), "
                                                  "kvcx2, kvcx2w or kvcx2v (these two measure the queries' "
                                                  "weights per key channel, then give each layer's keys a mean "
                                                  "width: 1 to 4 bits), "
                                                  "or any --scheme of compress; with --reuse, default: "
                                                  "the first plan's.")] = None,
    group_size: GroupOpt = None,
    bits: BitsOpt = None,
    options: Annotated[Optional[str], typer.Option("--options", help="Codecs to measure, by tag, e.g. b2,b3, "
                                                                    "b3g128 or value.b3a for one kind; widths keys: "
                                                                    "b1w,b1hw,...,b4w (h: and a half) (default: every "
                                                                    "option the scheme's plans choose from).")] = None,
    model: Annotated[Optional[str], typer.Option(help="HF id, local dir or .gguf (default: embedded SmolLM2-135M).")] = None,
    dataset_file: Annotated[Optional[Path], typer.Option("--dataset-file", help="Calibration text (WikiText-2 raw).")] = None,
    windows: Annotated[int, typer.Option(help="Windows of 1,024 tokens to measure on.")] = DEFAULT_WINDOWS,
    offset: Annotated[int, typer.Option(help="Windows skipped first (validate scores the first 32, the bench 64).")] = DEFAULT_OFFSET,
    reuse: Annotated[Optional[List[Path]], typer.Option("--reuse", help="Reuse the sensitivities of earlier plan "
                                                                        "files (no model run; repeat it to combine "
                                                                        "widths measured apart): only allocate "
                                                                        "--budget.")] = None,
    guard_retrieval: Annotated[Optional[int], typer.Option(
        "--guard-retrieval", help="Instead of --budget: a context length (e.g. 8192) at which to measure, on passkey "
                                  "prompts, which layers' keys carry the scheme's retrieval loss, and give those keys "
                                  "8 bits (the scheme defaults to kvcx).")] = None,
    guard_induction: Annotated[Optional[int], typer.Option(
        "--guard-induction", help="Instead of --budget: give 8-bit keys to this many layers (e.g. 3), those whose "
                                  "heads copy most on random tokens fed twice (induction heads: a probe of seconds, "
                                  "no data; the scheme defaults to kvcx).")] = None,
    prompts: Annotated[int, typer.Option(help="Passkey prompts --guard-retrieval measures on.")] = 8,
    protect: Annotated[float, typer.Option(help="--guard-retrieval: the share of the whole loss a layer's keys alone "
                                                "must carry to get 8 bits.")] = PROTECT,
    cpu: Annotated[bool, typer.Option("--cpu", metavar=FLAG, help="Force CPU even when CUDA is available.")] = False,
    device: DeviceOpt = None,
    keys_before_rope: KeysBeforeRopeOpt = False,
    threads: ThreadsOpt = None,
    json_out: JsonOpt = False,
):
    """Per-layer bit widths: measure each layer's sensitivity (KL divergence) at each width and spend --budget
    bits/value where it buys the most; or, with --guard-retrieval, give 8-bit keys to the layers that long-context
    retrieval needs."""
    if guard_induction is not None:
        unused = {"--budget": budget, "--reuse": reuse, "--options": options, "--dataset-file": dataset_file,
                  "--windows": windows != DEFAULT_WINDOWS, "--offset": offset != DEFAULT_OFFSET, "--device": device,
                  "--guard-retrieval": guard_retrieval, "--prompts": prompts != 8, "--protect": protect != PROTECT,
                  "--keys-before-rope": keys_before_rope}
        return _induction(out_path, guard_induction, scheme, group_size, bits, unused, model, cpu, threads, json_out)
    if guard_retrieval is not None:
        unused = {"--budget": budget, "--reuse": reuse, "--options": options, "--dataset-file": dataset_file,
                  "--windows": windows != DEFAULT_WINDOWS, "--offset": offset != DEFAULT_OFFSET, "--device": device,
                  "--keys-before-rope": keys_before_rope}
        return _guard(out_path, guard_retrieval, prompts, protect, scheme, group_size, bits, unused, model, cpu,
                      threads, json_out)
    with cli_errors("calibrate"):
        if budget is None:
            raise KvcxError("--budget is missing: the bits per value to spend, e.g. --budget 3.0 (or --guard-retrieval "
                            "8192 to guard a scheme's retrieval instead)")
        from kvcx.api import save_plan
        from kvcx.quality import calibrate as cal

        check_files_first(dataset=dataset_file, reuse=reuse, outputs=[(out_path, "plan")], sidecars=False)
        from kvcx.presses import split_scheme

        press, codec = split_scheme(scheme) if scheme else (None, None)
        if press is not None and codec is None:
            raise KvcxError(f"--scheme {scheme}: calibration spends one budget on bits and keep ratios; compose the "
                            f"press with a scheme, e.g. --scheme kvcx+{press.spec}")
        base = None if scheme is None and reuse else kv_config_from(codec or "kvcx3", group_size, bits, None, None,
                                                                 threads)
        if keys_before_rope:
            if reuse:
                raise KvcxError("--keys-before-rope measures the keys coded before RoPE; a plan from --reuse codes them "
                                "as its measured file did: leave the option out, or measure again without --reuse")
            if press is not None:
                raise KvcxError(f"--keys-before-rope: --scheme {scheme} composes a press; calibrate the codec alone")
            base = base.with_key_rope("model")
        from kvcx.quality import ranks

        follows = ranks.follows()   # under torchrun / accelerate launch: rank 0 reports and writes the plan
        if reuse:
            if follows:   # no model runs: rank 0 allocates alone
                return
            from kvcx.api import read_plan

            result = cal.reallocate([read_plan(p) for p in reuse], budget, source=[str(p) for p in reuse], base=base)
        else:
            on_phase = None if json_out or follows else print_phase
            with window_bar(json_out or follows) as on_window:
                result = cal.run_calibration(base, budget, model=model, dataset_file=dataset_file, windows=windows,
                                             offset=offset, cpu=cpu, device=device, options=_parse_options(options),
                                             on_phase=on_phase, on_window=on_window, press=press)
            if result is None:   # a rank other than 0: its windows' figures went to rank 0
                return
        save_plan(out_path, result)
    if json_out:
        emit_json(result.to_dict())
        return
    if not result.complete:
        out.print(f"[green]measured[/] → {out_path}: {len(result.sensitivity)} figures of "
                  f"{', '.join(sorted({k for k, _, _ in result.sensitivity}))} only, no plan yet: allocate with "
                  f"`kvcx calibrate --reuse {out_path} --reuse <other measurements> --budget B`; "
                  f"{result.tokens:,} tokens, {result.wall_time_s:.0f} s")
        return
    from kvcx.codecs.kvconfig import tag_of

    cfg = result.config
    if result.press is not None:
        keeps = result.press.layer_keep
        out.print(f"[green]plan[/] → {out_path}: {result.bits_per_value:.3f} bits/value counted whole (budget {budget}): "
                  f"{result.press.name} keeps {result.press.keep:.3f} of the tokens on average ({min(keeps):g} to "
                  f"{max(keeps):g} by layer), {len(cfg.layer_bits)} of {result.n_layers} layers' codecs changed, "
                  f"estimated KLD {result.estimated_kld:.4f}; {result.tokens:,} tokens, {result.wall_time_s:.0f} s")
        return
    if cfg.key.takes_weights:
        widths = [cfg.for_layer(L).key.bits for L in result.layer_indices]
        spread = f" ({min(widths):g} to {max(widths):g} by layer)" if min(widths) != max(widths) else ""
        kld = f", estimated KLD {result.estimated_kld:.4f}" if math.isfinite(result.estimated_kld) else ""
        out.print(f"[green]plan[/] → {out_path}: keys {sum(widths) / len(widths):.3f} bits per code on average{spread}, "
                  f"a width per channel weighed by the queries of {len(cfg.key_weights)} layers; "
                  f"{result.bits_per_value:.3f} bits/value nominal (budget {budget}){kld}; {result.tokens:,} tokens, "
                  f"{result.wall_time_s:.0f} s")
        return
    t = Table(title=f"most sensitive layers (mean KLD, nats/token, at the {cfg.key.bits}/{cfg.value.bits}-bit base)",
              header_style="bold")
    types = dict(result.layer_types)
    for c in ("kind", "layer", *(["type"] if types else []), "KLD", "codec in the plan", "KLD there"):
        t.add_column(c, justify="left" if c in ("kind", "type") else "right")
    planned = {L: (kb, vb) for L, kb, vb in cfg.layer_bits}
    ranked = sorted(result.base_sensitivity().items(), key=lambda kv: -kv[1])[:10]
    for (kind, L), v in ranked:
        sel = planned.get(L, (cfg.key.bits, cfg.value.bits))[0 if kind == "key" else 1]
        tag = tag_of(sel)
        there = result.sensitivity.get((kind, L, tag))
        t.add_row(kind, str(L), *([types.get(L, "")] if types else []), f"{v:.5f}", tag,
                  "estimated" if there is None else f"{there:.5f}")
    out.print(t)
    guessed = f", {result.extrapolated} figures estimated, not measured" if result.extrapolated else ""
    out.print(f"[green]plan[/] → {out_path}: {result.bits_per_value:.3f} bits/value nominal (budget {budget}), "
              f"{len(cfg.layer_bits)} of {len(result.layer_indices)} layers changed"
              f"{f' (the attention layers of {result.n_layers})' if types else ''}, estimated KLD "
              f"{result.estimated_kld:.4f}{guessed}; {result.tokens:,} tokens, {result.wall_time_s:.0f} s")



def _guard_base(option, what, unused, scheme, group_size, bits, threads):
    """The scheme a guard option starts from (kvcx by default): KvcxError for options it does not take or a press."""
    from kvcx.presses import split_scheme

    given = [name for name, v in unused.items() if v]
    if given:
        raise KvcxError(f"{option} {what}; leave out {', '.join(given)}")
    press, codec = split_scheme(scheme) if scheme else (None, "kvcx")
    if press is not None:
        raise KvcxError(f"--scheme {scheme}: {option} guards a codec's keys; give the scheme without its press (e.g. "
                        "--scheme kvcx)")
    return kv_config_from(codec, group_size, bits, None, None, threads)


def _guard(out_path, length, prompts, protect, scheme, group_size, bits, unused, model, cpu, threads, json_out):
    """``kvcx calibrate --guard-retrieval LENGTH``: the layers whose keys carry the retrieval loss, at 8 bits."""
    with cli_errors("calibrate"):
        from kvcx.api import save_plan
        from kvcx.quality.guard import GUARD_DEPTHS, check_guard, measure_guard

        config = _guard_base("--guard-retrieval", "measures the keys of one scheme on passkey prompts (no budget, "
                             "no text windows)", unused, scheme, group_size, bits, threads)
        check_guard(config, length, prompts, GUARD_DEPTHS, protect)
        check_files_first(outputs=[(out_path, "plan")], sidecars=False)
        with window_bar(json_out, "prompts") as on_prompt:
            result = measure_guard(config, length, prompts, protect=protect, model=model, cpu=cpu,
                                   on_prompt=on_prompt)
        save_plan(out_path, result)
    if json_out:
        emit_json(result.to_dict())
        return
    t = Table(title=f"log-probability of the answer lost, {result.prompts} passkey prompts at {length:,} tokens "
                    f"(nats; every layer coded: {result.whole:.3f})", header_style="bold")
    for c in ("layer", "keys alone coded", "share", "guarded"):
        t.add_column(c, justify="right")
    for i in sorted(range(result.n_layers), key=lambda i: -result.losses[i])[:8]:
        share = f"{result.losses[i] / result.whole:.0%}" if result.whole > 0 else "-"
        t.add_row(str(i), f"{result.losses[i]:.3f}", share, "8-bit keys" if i in result.layers else "")
    out.print(t)
    out.print(f"[green]plan[/] → {out_path}: {config.scheme} with 8-bit keys in "
              f"{len(result.layers)} of {result.n_layers} layers ({', '.join(map(str, result.layers)) or 'none'}): "
              f"{result.bits_per_value:.3f} bits/value nominal; {result.wall_time_s:.0f} s. Gate it: `kvcx validate "
              f"--task passkey --lengths {length} --depths 0.9 --plan {out_path}`")


def _induction(out_path, n, scheme, group_size, bits, unused, model, cpu, threads, json_out):
    """``kvcx calibrate --guard-induction N``: 8-bit keys in the N layers whose heads copy most (no data)."""
    with cli_errors("calibrate"):
        from kvcx.api import save_plan
        from kvcx.quality.induction import check_induction, induction_guard

        config = _guard_base("--guard-induction", "probes the model with random tokens (no budget, no text, no "
                             "passkey prompts)", unused, scheme, group_size, bits, threads)
        check_induction(config, n)
        check_files_first(outputs=[(out_path, "plan")], sidecars=False)
        result = induction_guard(config, n, model=model, cpu=cpu)
        save_plan(out_path, result)
    if json_out:
        emit_json(result.to_dict())
        return
    t = Table(title="induction score: attention from a random sequence's second copy to the token after the "
                    "earlier occurrence (the layer's strongest KV head)", header_style="bold")
    for c in ("layer", "score", "guarded"):
        t.add_column(c, justify="right")
    best = result.scores.max(-1)
    for i in sorted(range(result.n_layers), key=lambda i: -best[i])[:8]:
        t.add_row(str(i), f"{best[i]:.3f}", "8-bit keys" if i in result.layers else "")
    out.print(t)
    out.print(f"[green]plan[/] → {out_path}: {config.scheme} with 8-bit keys in {len(result.layers)} of "
              f"{result.n_layers} layers ({', '.join(map(str, result.layers))}): {result.bits_per_value:.3f} "
              f"bits/value nominal; {result.wall_time_s:.0f} s. Gate it: `kvcx validate --task passkey --lengths "
              f"8192 --depths 0.9 --plan {out_path}`")


def _parse_options(text: Optional[str]) -> Optional[List[str]]:
    if text is None:
        return None
    out = [f"b{t.strip()}" if t.strip().isdigit() else t.strip() for t in text.split(",") if t.strip()]
    if not out:
        raise KvcxError(f"--options {text!r} must be comma-separated option tags, e.g. b2,b3 or b3g128")
    return out


