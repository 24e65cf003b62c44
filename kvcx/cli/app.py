"""The ``kvcx`` Typer application and what its commands share: the error handling (a red line, exit 1), the
pre-flight checks of files, the codec settings from options, the metrics report and the shared options. The
commands live in their own modules (:mod:`kvcx.cli.files`, :mod:`kvcx.cli.validate`, :mod:`kvcx.cli.calibrate`,
:mod:`kvcx.cli.serve`), which register on :data:`app`.

Exit codes: 0 success, 1 error (bad input; one red line, no traceback),
2 usage error (unknown option, bad value), 3 quality check failed
(thresholds of ``metrics`` and of ``compress --check``, perplexity delta of ``validate``).
"""
from __future__ import annotations

import logging
import re
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape

from kvcx.cli.render import (
    emit_json,
    err,
    metrics_table,
    out,
    tensor_table,
)
from kvcx.errors import KvcxError
from kvcx.version import VERSION as __version__

EXIT_ERROR = 1
EXIT_QUALITY = 3
FLAG = ""   # a flag's metavar: an empty type column (Typer shows "<bool>" there, which reads as if it took a value)

app = typer.Typer(rich_markup_mode="rich", add_completion=False, no_args_is_help=True,
                  context_settings={"help_option_names": ["-h", "--help"]},
                  help="Compress LLM KV caches to packed low-bit codes (2, 3, 4 or 8 bits, or an engine's format) and "
                       "prove with perplexity that they still serve the model.")


def _version(value: bool):
    if value:
        typer.echo(f"kvcx {__version__}")
        raise typer.Exit()


# What transformers imports whenever it is installed, talking at import: torchao on a CPU build of torch logs
# "Failed to load ..." for each of its CUDA extensions, and torch's pytree a deprecation for each of torchao's enums.
# Nothing a kvcx command does or can mend (it uses neither), and on a first `kvcx validate` it reads as a failure;
# the command line quiets these loggers below ERROR. The library leaves logging alone.
QUIET_LOGGERS = ("torchao", "torch.utils._pytree")


def quiet_imports() -> None:
    """Raise :data:`QUIET_LOGGERS` to ERROR: each command runs this first (the application's callback)."""
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)


@app.callback()
def _main(version: Annotated[Optional[bool], typer.Option("--version", metavar=FLAG, callback=_version, is_eager=True,
                                                          help="Print the version and exit.")] = None):
    quiet_imports()


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
def cli_errors(command: Optional[str] = None):
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


def count_tensors(path: Path) -> int:
    from kvcx.formats.safetensors import SafeFile

    with SafeFile(path) as f:
        return len(f.keys())


def check_files_first(inputs=(), plan=None, dataset=None, reuse=(), outputs=(), sidecars=True) -> None:
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


def kv_config_from(scheme, group_size, bits, sinks, rotate, threads, plan=None):
    from kvcx.codecs.kvconfig import KVConfig

    if plan is not None:
        from kvcx.api import load_plan

        cfg = load_plan(plan, n_threads=threads)
        if not isinstance(cfg, KVConfig):     # a plan with keep ratios per layer (a press)
            raise KvcxError(f"--plan {plan}: the plan evicts tokens ({cfg.press.name}, keep ratios per layer); compress "
                            "and metrics keep every token of a file: use it with `kvcx validate --plan` or KvcxCache")
        return cfg
    return KVConfig.from_scheme(scheme, group_size=group_size, bits=bits, sinks=sinks, rotate=rotate,
                                n_threads=threads)


def report_metrics(m, json_out: bool, title: str, check: bool, wrote: Optional[Path] = None) -> None:
    """Print the metrics; with ``check`` a missed threshold or a warning is exit 3, else a yellow warning (file
    kept)."""
    for w in m.warnings:
        err.print(f"[{'red' if check else 'yellow'}]Warning: {escape(w)}[/]")
    if json_out:
        emit_json(m.to_dict())
    else:
        out.print(metrics_table(m, title))
        out.print(tensor_table(m))
        if m.passed:
            out.print("[bold green]PASSED[/] quality thresholds (reference design: RMSE, SNR, cosine)")
        elif check:
            out.print("[bold red]FAILED[/] quality thresholds: " + "; ".join(m.violations))
    if not m.passed and not check and m.num_values:   # (nothing compressed: its warning says so)
        err.print(f"[yellow]Warning: {escape(str(wrote))} was written, but it misses the reference design's "
                  f"thresholds: {escape('; '.join(m.violations))}. Pass --check to make this exit 3.[/]")
    if check and (not m.passed or m.warnings):
        raise typer.Exit(code=EXIT_QUALITY)


# shared options
SchemeOpt = Annotated[str, typer.Option("--scheme", help="reference | symmetric | asymmetric | kivi | kvcx (default) "
                                                         "| kvcx4w (keys a width per channel) | kvcx3 | kvcx2 | "
                                                         "kvcx2w | kvcx2v (low-bit presets; kvcx2v: E8P lattice "
                                                         "values, no calibration) | engine formats: "
                                                         "q8_0 q4_0 q4_1 q5_0 q5_1 iq4_nl (llama.cpp; -rot: with its "
                                                         "rotation) fp8_e4m3 fp8_e5m2 (vLLM; -amax: calibrated "
                                                         "scale) mxfp4 (ggml) nvfp4 nvfp4-amax (TensorRT-LLM) "
                                                         "turboquant_4bit_nc turboquant_k3v4_nc turboquant_3bit_nc "
                                                         "turboquant_k8v4 (vLLM's TurboQuant); "
                                                         "validate also: quanto-int4 quanto-int2 "
                                                         "hqq-int4 hqq-int2 hqq-int4-axis1 hqq-int2-axis1 "
                                                         "turboquant-4 turboquant-3 nexusquant-k4v4 "
                                                         "nexusquant-k3v2 nexusquant-k2v2 "
                                                         "(kvcx\\[peers]).")]
PlanOpt = Annotated[Optional[str], typer.Option("--plan", help="A plan from `kvcx calibrate --out`, or a shipped "
                                                               "plan's name (smollm2-kvcx2w-2.47, ...); replaces "
                                                               "--scheme/--bits/--group-size.")]
GroupOpt = Annotated[Optional[int], typer.Option("--group-size", "-g", help="Values per group: 16, 32, 64 (default), "
                                                                         "128 or 256.")]
BitsOpt = Annotated[Optional[int], typer.Option("--bits", help="Code width: 4 (default), 3, 2 or 8.")]
SinksOpt = Annotated[Optional[int], typer.Option("--sinks", help="Leading tokens kept exact (scheme default if unset).")]
RotateOpt = Annotated[Optional[bool], typer.Option("--rotate/--no-rotate", metavar=FLAG, help="Hadamard-rotate head_dim first.")]
KeysBeforeRopeOpt = Annotated[bool, typer.Option("--keys-before-rope", metavar=FLAG,
                                                 help="Code kvcx's keys in the frame before the model's RoPE (turned "
                                                      "back after decoding; prefix and engine modes, retrieval).")]
ThreadsOpt = Annotated[Optional[int], typer.Option("--threads", help="OpenMP threads (default: all cores).")]
DeviceOpt = Annotated[Optional[str], typer.Option("--device", help="Where the model runs: cpu, cuda, cuda:N, or auto "
                                                                   "(one model spread over this machine's GPUs, for "
                                                                   "one no GPU holds alone; needs accelerate). Default: "
                                                                   "CUDA when there is one (under a launcher the GPU "
                                                                   "LOCAL_RANK names).")]
JsonOpt = Annotated[bool, typer.Option("--json", metavar=FLAG, help="Machine-readable JSON on stdout, nothing else there.")]
RmseOpt = Annotated[float, typer.Option("--max-rmse", help="Threshold: absolute RMSE below this.")]
SnrOpt = Annotated[float, typer.Option("--min-snr", help="Threshold: SNR (dB) above this.")]
CosOpt = Annotated[float, typer.Option("--min-cosine", help="Threshold: cosine similarity above this.")]
CheckOpt = Annotated[bool, typer.Option("--check", metavar=FLAG, help="Exit 3 when the thresholds are missed or a warning is "
                                                        "raised (the file is still written); without it both are "
                                                        "warnings.")]
SparsityOpt = Annotated[float, typer.Option(help="Fraction of smallest-magnitude values zeroed first (0 = off).")]
Lz4Opt = Annotated[bool, typer.Option("--lz4", metavar=FLAG, help="LZ4-compress the packed codes.")]


