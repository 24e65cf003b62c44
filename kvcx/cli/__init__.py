"""The ``kvcx`` command line: thin Typer commands over the library.

Exit codes: 0 success, 1 error (bad input; one red line, no traceback),
2 usage error (unknown option, bad value), 3 quality check failed
(thresholds of ``metrics`` and of ``compress --check``, perplexity delta of ``validate``).

All rendering (rich tables, progress bars, colours) lives in this package (the
tables and bars in :mod:`kvcx.cli.render`); the library reports progress through
callbacks and returns results.
"""
from __future__ import annotations

import re
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, List, Optional

import typer
from rich.markup import escape
from rich.table import Table

from kvcx.cli.render import (
    emit_json,
    err,
    metrics_table,
    out,
    print_phase,
    print_validation,
    print_passkey,
    print_validations,
    progress,
    tensor_table,
    window_bar,
)
from kvcx.errors import KvcxError
from kvcx.version import VERSION as __version__

EXIT_ERROR = 1
EXIT_QUALITY = 3

app = typer.Typer(rich_markup_mode="rich", add_completion=False, no_args_is_help=True,
                  context_settings={"help_option_names": ["-h", "--help"]},
                  help="Compress LLM KV caches to packed INT4 and prove with perplexity that they still serve the model.")


def _version(value: bool):
    if value:
        typer.echo(f"kvcx {__version__}")
        raise typer.Exit()


@app.callback()
def _main(version: Annotated[Optional[bool], typer.Option("--version", callback=_version, is_eager=True,
                                                          help="Print the version and exit.")] = None):
    pass


_PARAM = re.compile(r"\b([a-z][a-z_]*)=('[^']*'|\S+?)(?=[\s,;:)]|$)")


def in_flags(message: str, command: Optional[str]) -> str:
    """A library message in the command line's words: each ``name=value`` of a parameter that ``command``
    has as an option becomes ``--flag value`` (``rotate=False`` becomes ``--no-rotate``)."""
    if command is None:
        return message
    opts = {p.name: p for p in typer.main.get_command(app).commands[command].params
            if getattr(p, "opts", None) and p.opts[0].startswith("--")}

    def flag(m):
        opt = opts.get(m.group(1))
        if opt is None:
            return m.group(0)
        value = m.group(2).strip("'")
        if opt.is_flag and value in ("True", "False"):
            return (opt.opts if value == "True" or not opt.secondary_opts else opt.secondary_opts)[0]
        return f"{opt.opts[0]} {value}"

    return _PARAM.sub(flag, message)


@contextmanager
def _errors(command: Optional[str] = None):
    """Turn kvcx's own errors (and a few OS ones) into a red line and exit code 1, in ``command``'s words."""
    try:
        yield
    except KvcxError as exc:
        err.print(f"[bold red]Error:[/] [red]{escape(in_flags(str(exc), command))}[/]")
        raise typer.Exit(code=EXIT_ERROR) from None
    except MemoryError as exc:
        err.print(f"[bold red]Error:[/] [red]out of memory: {escape(str(exc))}[/]")
        raise typer.Exit(code=EXIT_ERROR) from None
    except OSError as exc:
        err.print(f"[bold red]Error:[/] [red]{escape(str(exc.filename or ''))}: {escape(str(exc.strerror or exc))}[/]")
        raise typer.Exit(code=EXIT_ERROR) from None


def _count_tensors(path: Path) -> int:
    from kvcx.formats.safetensors import SafeFile

    with SafeFile(path) as f:
        return len(f.keys())


def _check_files(inputs=(), plan=None, dataset=None, reuse=(), outputs=(), sidecars=True) -> None:
    """Everything a command reads and writes, checked together before any work (kvcx.formats.atomic.check_files):
    inputs and their sidecars, the plan, the evaluation text, reused measurements; outputs and their sidecars."""
    import os

    from kvcx.formats.atomic import check_files
    from kvcx.formats.jsonio import sidecar_path

    reads, writes = [], []
    for i in inputs:
        reads.append((i, "input file"))
        if sidecars and os.path.lexists(sidecar_path(i)):
            reads.append((sidecar_path(i), "input file's sidecar"))
    if plan is not None:
        from kvcx.api import plan_file

        if os.path.exists(plan_file(plan)):   # a missing plan is reported when it is loaded, with how to make one
            reads.append((plan_file(plan), "plan file"))
    if dataset is None and os.environ.get("KVCX_DATASET_FILE"):
        dataset = os.environ["KVCX_DATASET_FILE"]
    if dataset is not None and os.path.exists(dataset):
        reads.append((dataset, "evaluation text file"))
    reads += [(r, "reused plan file") for r in reuse or () if os.path.exists(r)]
    for o, what in outputs:
        writes.append((o, what))
        if sidecars and what == "output":
            writes.append((sidecar_path(o), "output's sidecar"))
    check_files(reads, writes)


def _kv_config(scheme, group_size, bits, sinks, rotate, threads, plan=None):
    from kvcx.codecs.kvconfig import KVConfig

    if plan is not None:
        from kvcx.api import load_plan

        return load_plan(plan, n_threads=threads)
    return KVConfig.from_scheme(scheme, group_size=group_size, bits=bits, sinks=sinks, rotate=rotate,
                                n_threads=threads)


def _report(m, json_out: bool, title: str, check: bool, wrote: Optional[Path] = None) -> None:
    """Print the metrics; with ``check`` a missed threshold is exit 3, else a yellow warning (file kept)."""
    if json_out:
        emit_json(m.to_dict())
    else:
        out.print(metrics_table(m, title))
        out.print(tensor_table(m))
        if m.passed:
            out.print("[bold green]PASSED[/] quality thresholds (reference design: RMSE, SNR, cosine)")
        elif check:
            out.print("[bold red]FAILED[/] quality thresholds: " + "; ".join(m.violations))
    if not m.passed and not check:
        err.print(f"[yellow]Warning: {escape(str(wrote))} was written, but it misses the reference design's "
                  f"thresholds: {escape('; '.join(m.violations))}. Absolute RMSE depends on the model's cache "
                  "scale: judge by relative RMSE / SNR, or by `kvcx validate` (perplexity). "
                  "Pass --check to make this exit 3.[/]")
    if not m.passed and check:
        raise typer.Exit(code=EXIT_QUALITY)


# shared options
SchemeOpt = Annotated[str, typer.Option("--scheme", help="reference | symmetric | asymmetric | kivi | kvcx (default) "
                                                         "| kvcx3 | kvcx2 | kvcx2w (low-bit presets) | engine formats: "
                                                         "q8_0 q4_0 q4_1 q5_0 q5_1 iq4_nl (llama.cpp; -rot: with its "
                                                         "rotation) fp8_e4m3 fp8_e5m2 (vLLM; -amax: calibrated "
                                                         "scale); validate also: quanto-int4 quanto-int2 "
                                                         "hqq-int4 hqq-int2 hqq-int4-axis1 hqq-int2-axis1 "
                                                         "turboquant-4 turboquant-3 "
                                                         "(kvcx[peers]).")]
PlanOpt = Annotated[Optional[str], typer.Option("--plan", help="A plan from `kvcx calibrate --out`, or a shipped "
                                                               "plan's name (smollm2-kvcx2w-2.47, ...); replaces "
                                                               "--scheme/--bits/--group-size.")]
GroupOpt = Annotated[Optional[int], typer.Option("--group-size", "-g", help="Values per group: 16, 32, 64 (default), "
                                                                         "128 or 256.")]
BitsOpt = Annotated[Optional[int], typer.Option("--bits", help="Code width: 4 (default), 3, 2 or 8.")]
SinksOpt = Annotated[Optional[int], typer.Option("--sinks", help="Leading tokens kept exact (scheme default if unset).")]
RotateOpt = Annotated[Optional[bool], typer.Option("--rotate/--no-rotate", help="Hadamard-rotate head_dim first.")]
ThreadsOpt = Annotated[Optional[int], typer.Option("--threads", help="OpenMP threads (default: all cores).")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Machine-readable JSON on stdout, nothing else there.")]
RmseOpt = Annotated[float, typer.Option("--max-rmse", help="Threshold: absolute RMSE below this.")]
SnrOpt = Annotated[float, typer.Option("--min-snr", help="Threshold: SNR (dB) above this.")]
CosOpt = Annotated[float, typer.Option("--min-cosine", help="Threshold: cosine similarity above this.")]
CheckOpt = Annotated[bool, typer.Option("--check", help="Exit 3 when the thresholds are missed (the file is "
                                                        "still written); without it a miss is a warning.")]
SparsityOpt = Annotated[float, typer.Option(help="Fraction of smallest-magnitude values zeroed first (0 = off).")]
Lz4Opt = Annotated[bool, typer.Option("--lz4", help="LZ4-compress the packed codes.")]


@app.command()
def compress(
    input: Annotated[Path, typer.Argument(help="Input .safetensors KV cache.")],
    output: Annotated[Path, typer.Argument(help="Output packed .safetensors file (written atomically).")],
    group_size: GroupOpt = None,
    scheme: SchemeOpt = "kvcx",
    bits: BitsOpt = None,
    sinks: SinksOpt = None,
    rotate: RotateOpt = None,
    sparsity: SparsityOpt = 0.0,
    lz4: Lz4Opt = False,
    plan: PlanOpt = None,
    threads: ThreadsOpt = None,
    max_rmse: RmseOpt = 0.10,
    min_snr: SnrOpt = 18.0,
    min_cosine: CosOpt = 0.99,
    check: CheckOpt = False,
    json_out: JsonOpt = False,
):
    """Compress a safetensors KV cache into a packed INT4 kvcx file (exit 0 once it is written)."""
    with _errors("compress"):
        from kvcx.api import Thresholds, compress_kv_cache

        _check_files(inputs=[input], plan=plan, outputs=[(output, "output")])
        cfg = _kv_config(scheme, group_size, bits, sinks, rotate, threads, plan)
        with progress(_count_tensors(input), "compressing", quiet=False) as step:
            m = compress_kv_cache(input, output, config=cfg, sparsity=sparsity, lz4=lz4,
                                  thresholds=Thresholds(max_rmse, min_snr, min_cosine), progress=step)
    _report(m, json_out, f"kvcx compress → {output}", check=check, wrote=output)


@app.command()
def decompress(
    input: Annotated[Path, typer.Argument(help="Packed kvcx .safetensors file.")],
    output: Annotated[Path, typer.Argument(help="Output plain .safetensors file (written atomically).")],
    threads: ThreadsOpt = None,
    json_out: JsonOpt = False,
):
    """Restore a packed kvcx file to plain safetensors (original names, shapes and dtypes)."""
    with _errors("decompress"):
        from kvcx.api import decompress_kv_cache

        _check_files(inputs=[input], outputs=[(output, "output")])
        with progress(_count_tensors(input), "decompressing") as step:
            r = decompress_kv_cache(input, output, n_threads=threads, progress=step)
    if json_out:
        emit_json(r)
    else:
        out.print(f"[green]restored[/] {r['tensors']} tensors → {output} ({r['restored_size_bytes']:,} B, "
                  f"{r['processing_time_ms']:.1f} ms)")


@app.command()
def metrics(
    input: Annotated[Path, typer.Argument(help="Input .safetensors KV cache.")],
    group_size: GroupOpt = None,
    scheme: SchemeOpt = "kvcx",
    bits: BitsOpt = None,
    sinks: SinksOpt = None,
    rotate: RotateOpt = None,
    sparsity: SparsityOpt = 0.0,
    lz4: Lz4Opt = False,
    plan: PlanOpt = None,
    threads: ThreadsOpt = None,
    max_rmse: RmseOpt = 0.10,
    min_snr: SnrOpt = 18.0,
    min_cosine: CosOpt = 0.99,
    plot: Annotated[Optional[Path], typer.Option("--plot", help="Also draw per-layer x per-head SNR (keys | values) "
                                                              "to this PNG (needs kvcx[plot]).")] = None,
    json_out: JsonOpt = False,
):
    """Quality and size of compressing a file (no file written); exit 3 when a threshold is missed."""
    with _errors("metrics"):
        from kvcx.api import Thresholds, get_compression_metrics

        # a picture that cannot be written, or that would replace an input, fails before any work
        _check_files(inputs=[input], plan=plan, outputs=[(plot, "picture")] if plot is not None else [])
        cfg = _kv_config(scheme, group_size, bits, sinks, rotate, threads, plan)
        with progress(_count_tensors(input), "measuring") as step:
            m = get_compression_metrics(input, config=cfg, sparsity=sparsity, lz4=lz4,
                                        thresholds=Thresholds(max_rmse, min_snr, min_cosine), progress=step)
        if plot is not None:
            from kvcx.quality.plots import snr_heatmap

            snr_heatmap(input, cfg, plot, n_threads=threads)
            if not json_out:
                err.print(f"[green]heatmap[/] → {escape(str(plot))}")
    _report(m, json_out, f"kvcx metrics: {input}", check=True)


@app.command()
def info(json_out: JsonOpt = False):
    """Show how the kernels were built: OpenMP, threads, SIMD flags."""
    from kvcx.codecs.runtime import build_info

    i = build_info()
    i["version"] = __version__
    if json_out:
        emit_json(i)
        return
    t = Table(title="kvcx build", header_style="bold")
    t.add_column("item")
    t.add_column("value")
    for k in ("version", "openmp", "max_threads", "threads_used", "omp_num_threads_env", "simd", "f16c_kernels"):
        v = i[k]
        t.add_row(k, " ".join(v) if isinstance(v, list) else str(v))
    out.print(t)


@app.command()
def validate(
    threshold: Annotated[float, typer.Option(help="PASS when the perplexity delta is below this (KVQuant: 0.5).")] = 0.5,
    model: Annotated[Optional[str], typer.Option(help="HF id, local dir or .gguf (default: embedded SmolLM2-135M).")] = None,
    dataset_file: Annotated[Optional[Path], typer.Option("--dataset-file", help="WikiText-2 raw test text file.")] = None,
    window: Annotated[Optional[int], typer.Option(help="Tokens per window (default 1024 or the model's context).")] = None,
    stride: Annotated[int, typer.Option(help="Tokens scored per window; the rest is the compressed context.")] = 512,
    max_windows: Annotated[int, typer.Option("--max-windows", help="Windows to evaluate (0 = whole test set).")] = 32,
    group_size: GroupOpt = None,
    scheme: SchemeOpt = "kvcx",
    bits: BitsOpt = None,
    sinks: SinksOpt = None,
    rotate: RotateOpt = None,
    mode: Annotated[str, typer.Option(help="prefix: compress the context cache once; generation: through KvcxCache "
                                           "as the model runs; engine: every key/value, the current token's included, "
                                           "through the codec before attention (vLLM, llama.cpp).")] = "prefix",
    cpu: Annotated[bool, typer.Option("--cpu", help="Force CPU even when CUDA is available.")] = False,
    backend: Annotated[Optional[str], typer.Option("--backend", help="Where kvcx compresses the cache: triton (on "
                                                                     "the GPU; 4-bit codecs) or cpu (default: by "
                                                                     "the model's device).")] = None,
    plan: PlanOpt = None,
    threads: ThreadsOpt = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Only the verdict line.")] = False,
    quick_test: Annotated[bool, typer.Option("--quick-test", help="No model: a synthetic TinyLlama-shaped cache, "
                                                                  "judged on RMSE/SNR/cosine.")] = False,
    gate: Annotated[Optional[str], typer.Option("--gate", help="With several --scheme settings: the ones that must "
                                                               "pass for exit 0 (comma-separated; default: all).")] = None,
    pareto: Annotated[Optional[Path], typer.Option("--pareto", help="Also draw bits/value vs perplexity delta of "
                                                                    "every setting to this PNG (needs kvcx[plot]).")] = None,
    task: Annotated[str, typer.Option("--task", help="perplexity (default), or passkey: a key hidden in long "
                                                     "contexts, found with the exact vs the compressed cache.")] = "perplexity",
    lengths: Annotated[Optional[str], typer.Option("--lengths", help="passkey: context lengths, comma-separated "
                                                                     "(default 1024, 2048, ... the model's context).")] = None,
    prompts: Annotated[int, typer.Option("--prompts", help="passkey: prompts per length and depth.")] = 2,
    tolerance: Annotated[int, typer.Option("--tolerance", help="passkey: prompts a setting may answer fewer than "
                                                               "the exact cache at a length.")] = 1,
    json_out: JsonOpt = False,
):
    """Perplexity with the exact vs the compressed KV cache on WikiText-2 (exit 3 when delta >= threshold).

    Several settings in one pass: --scheme kvcx,q4_0-rot,fp8_e4m3 scores the baseline once and every setting
    on the same windows and tokens (one table; --json a list). --task passkey: retrieval at long contexts."""
    with _errors("validate"):
        from kvcx.quality import validation

        _check_files(plan=plan, dataset=dataset_file, outputs=[(pareto, "picture")] if pareto is not None else [],
                     sidecars=False)
        from kvcx.api import validation_settings

        from kvcx.quality.peers import PEERS

        configs, gated = validation_settings(scheme, plan, gate, group_size, bits, sinks, rotate, threads, peers=PEERS)
        on_phase = None if (json_out or quiet) else print_phase
        if task not in ("perplexity", "passkey"):
            raise KvcxError(f"--task {task!r} must be perplexity or passkey")
        if task != "passkey" and lengths is not None:
            raise KvcxError("--lengths sets the passkey task's contexts; add --task passkey, or use --window for "
                            "perplexity")
        if backend is not None and (task == "passkey" or quick_test):
            raise KvcxError("--backend chooses where a model's cache is compressed for perplexity; --task passkey "
                            "and --quick-test do not take it: leave it out")
        if task == "passkey":
            return _passkey(configs, gated, lengths, prompts, tolerance, model, cpu, mode, quiet, json_out, on_phase)
        if quick_test:
            results = [validation.quick_test(c, on_phase=on_phase, label=label) for label, c in configs.items()]
        else:
            with window_bar(quiet) as on_window:
                results = validation.run_validations(
                    configs, threshold=threshold, model=model, dataset_file=dataset_file, window=window,
                    stride=stride, max_windows=max_windows, mode=mode, cpu=cpu, on_phase=on_phase,
                    on_window=on_window, backend=backend)
        if pareto is not None:
            from kvcx.quality.plots import validation_pareto

            validation_pareto(results, pareto, title=f"{results[0].model}: {results[0].tokens_scored:,} tokens, "
                                                     f"windows of {results[0].window} ({results[0].mode} mode)")
    if len(results) == 1:
        result = results[0]
        if json_out:
            emit_json(result.to_dict())
        elif quiet:
            out.print(result.verdict_line())
        else:
            print_validation(result)
    elif json_out:
        emit_json([r.to_dict() for r in results])
    else:
        print_validations(results, gated, quiet)
    if any(not r.passed for r in results if r.setting in gated or len(results) == 1):
        raise typer.Exit(code=EXIT_QUALITY)


def _passkey(configs, gated, lengths, prompts, tolerance, model, cpu, mode, quiet, json_out, on_phase):
    from kvcx.quality.passkey import run_passkey

    if mode != "prefix":
        raise KvcxError(f"--task passkey runs in prefix mode (the prompt's cache compressed once); not --mode {mode}")
    try:
        parsed = [int(x) for x in lengths.split(",") if x.strip()] if lengths else None
    except ValueError:
        raise KvcxError(f"--lengths {lengths!r} must be token counts, comma-separated (e.g. 1024,4096)") from None
    with window_bar(quiet, "prompts") as on_prompt:
        results = run_passkey(configs, lengths=parsed, prompts=prompts, tolerance=tolerance, model=model, cpu=cpu,
                              on_phase=on_phase, on_prompt=on_prompt)
    if json_out:
        emit_json(results[0].to_dict() if len(results) == 1 else [r.to_dict() for r in results])
    else:
        print_passkey(results, gated, quiet)
    if any(not r.passed for r in results if r.setting in gated):
        raise typer.Exit(code=EXIT_QUALITY)


@app.command()
def calibrate(
    out_path: Annotated[Path, typer.Option("--out", "-o", help="Plan file to write (JSON, atomically); pass it to "
                                                                "compress/metrics/validate --plan.")],
    budget: Annotated[float, typer.Option(help="Nominal bits per value to spend (codes, scales, zero points).")],
    scheme: Annotated[Optional[str], typer.Option("--scheme", help="Base scheme: kvcx3 (default when measuring), "
                                                  "kvcx2, kvcx2w (measures the queries' weights per key "
                                                  "channel), or any --scheme of compress; with --reuse, default: "
                                                  "the first plan's.")] = None,
    group_size: GroupOpt = None,
    bits: BitsOpt = None,
    options: Annotated[Optional[str], typer.Option("--options", help="Codecs to measure, by tag, e.g. b2,b3, "
                                                                    "b3g128 or value.b3a for one kind (default: every "
                                                                    "option the scheme's plans choose from).")] = None,
    model: Annotated[Optional[str], typer.Option(help="HF id, local dir or .gguf (default: embedded SmolLM2-135M).")] = None,
    dataset_file: Annotated[Optional[Path], typer.Option("--dataset-file", help="Calibration text (WikiText-2 raw).")] = None,
    windows: Annotated[int, typer.Option(help="Windows of 1,024 tokens to measure on.")] = 4,
    offset: Annotated[int, typer.Option(help="Windows skipped first (validate scores the first 32, the bench 64).")] = 128,
    reuse: Annotated[Optional[List[Path]], typer.Option("--reuse", help="Reuse the sensitivities of earlier plan "
                                                                        "files (no model run; repeat it to combine "
                                                                        "widths measured apart): only allocate "
                                                                        "--budget.")] = None,
    cpu: Annotated[bool, typer.Option("--cpu", help="Force CPU even when CUDA is available.")] = False,
    threads: ThreadsOpt = None,
    json_out: JsonOpt = False,
):
    """Per-layer bit widths: measure each layer's sensitivity (KL divergence) at each width and spend --budget
    bits/value where it buys the most."""
    with _errors("calibrate"):
        from kvcx.api import save_plan
        from kvcx.quality import calibrate as cal

        _check_files(dataset=dataset_file, reuse=reuse, outputs=[(out_path, "plan")], sidecars=False)
        base = None if scheme is None and reuse else _kv_config(scheme or "kvcx3", group_size, bits, None, None,
                                                                 threads)
        if reuse:
            from kvcx.api import read_plan

            result = cal.reallocate([read_plan(p) for p in reuse], budget, source=[str(p) for p in reuse], base=base)
        else:
            on_phase = None if json_out else print_phase
            with window_bar(json_out) as on_window:
                result = cal.run_calibration(base, budget, model=model, dataset_file=dataset_file, windows=windows,
                                             offset=offset, cpu=cpu, options=_parse_options(options),
                                             on_phase=on_phase, on_window=on_window)
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
    if cfg.key.takes_weights:
        out.print(f"[green]plan[/] → {out_path}: keys {cfg.key.bits:g} bits per code on average, a width per channel "
                  f"weighed by the queries of {len(cfg.key_weights)} layers; {result.bits_per_value:.3f} bits/value "
                  f"nominal (budget {budget}); {result.tokens:,} tokens, {result.wall_time_s:.0f} s")
        return
    t = Table(title=f"most sensitive layers (mean KLD, nats/token, at the {cfg.key.bits}/{cfg.value.bits}-bit base)",
              header_style="bold")
    for c in ("kind", "layer", "KLD", "codec in the plan", "KLD there"):
        t.add_column(c, justify="left" if c == "kind" else "right")
    planned = {L: (kb, vb) for L, kb, vb in cfg.layer_bits}
    ranked = sorted(result.base_sensitivity().items(), key=lambda kv: -kv[1])[:10]
    for (kind, L), v in ranked:
        sel = planned.get(L, (cfg.key.bits, cfg.value.bits))[0 if kind == "key" else 1]
        tag = tag_of(sel)
        there = result.sensitivity.get((kind, L, tag))
        t.add_row(kind, str(L), f"{v:.5f}", tag, "estimated" if there is None else f"{there:.5f}")
    out.print(t)
    guessed = f", {result.extrapolated} figures estimated, not measured" if result.extrapolated else ""
    out.print(f"[green]plan[/] → {out_path}: {result.bits_per_value:.3f} bits/value nominal (budget {budget}), "
              f"{len(cfg.layer_bits)} of {result.n_layers} layers changed, estimated KLD "
              f"{result.estimated_kld:.4f}{guessed}; {result.tokens:,} tokens, {result.wall_time_s:.0f} s")


@app.command("lmcache-server", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def lmcache_server(ctx: typer.Context):
    """Run LMCache's multiprocess server with the kvcx serde registered; every flag goes to [bold]lmcache
    server[/] (see its --help). A kvcx serde in an --l2-adapter is checked before the server starts.

    Example: kvcx lmcache-server --port 5555 --supported-transfer-mode auto --eviction-policy LRU
    --l2-adapter '{"type": "fs", "base_path": "/cache", "serde": {"type": "kvcx", "layout": "vllm_cpu",
    "block_size": 128}}'
    """
    with _errors():
        from kvcx.integrations.lmcache import check_server_args, run_server

        check_server_args(ctx.args)
    run_server(ctx.args)


def _parse_options(text: Optional[str]) -> Optional[List[str]]:
    if text is None:
        return None
    out = [f"b{t.strip()}" if t.strip().isdigit() else t.strip() for t in text.split(",") if t.strip()]
    if not out:
        raise KvcxError(f"--options {text!r} must be comma-separated option tags, e.g. b2,b3 or b3g128")
    return out


def main():  # console-script entry point
    app()


if __name__ == "__main__":
    main()
