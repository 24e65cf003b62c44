"""``kvcx compress``, ``decompress``, ``metrics`` and ``info``: the file commands."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape
from rich.table import Table

from kvcx.cli.app import (BitsOpt, CheckOpt, CosOpt, GroupOpt, JsonOpt, Lz4Opt, PlanOpt,
                          RmseOpt, RotateOpt, SchemeOpt, SinksOpt, SnrOpt, SparsityOpt, ThreadsOpt, check_files_first,
                          count_tensors, cli_errors, kv_config_from, report_metrics, app)
from kvcx.cli.render import (emit_json, err, out, progress)
from kvcx.version import VERSION as __version__


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
    """Compress a safetensors KV cache into a packed kvcx file (exit 0 once it is written)."""
    with cli_errors("compress"):
        from kvcx.api import Thresholds, compress_kv_cache

        check_files_first(inputs=[input], plan=plan, outputs=[(output, "output")])
        cfg = kv_config_from(scheme, group_size, bits, sinks, rotate, threads, plan)
        with progress(count_tensors(input), "compressing", quiet=False) as step:
            m = compress_kv_cache(input, output, config=cfg, sparsity=sparsity, lz4=lz4,
                                  thresholds=Thresholds(max_rmse, min_snr, min_cosine), progress=step)
    report_metrics(m, json_out, f"kvcx compress → {output}", check=check, wrote=output)


@app.command()
def decompress(
    input: Annotated[Path, typer.Argument(help="Packed kvcx .safetensors file.")],
    output: Annotated[Path, typer.Argument(help="Output plain .safetensors file (written atomically).")],
    threads: ThreadsOpt = None,
    json_out: JsonOpt = False,
):
    """Restore a packed kvcx file to plain safetensors (original names, shapes and dtypes)."""
    with cli_errors("decompress"):
        from kvcx.api import decompress_kv_cache

        check_files_first(inputs=[input], outputs=[(output, "output")])
        with progress(count_tensors(input), "decompressing") as step:
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
                                                              "to this PNG (needs kvcx\\[plot]).")] = None,
    json_out: JsonOpt = False,
):
    """Quality and size of compressing a file (no file written); exit 3 when a threshold is missed."""
    with cli_errors("metrics"):
        from kvcx.api import Thresholds, get_compression_metrics

        # a picture that cannot be written, or that would replace an input, fails before any work
        check_files_first(inputs=[input], plan=plan, outputs=[(plot, "picture")] if plot is not None else [])
        cfg = kv_config_from(scheme, group_size, bits, sinks, rotate, threads, plan)
        with progress(count_tensors(input), "measuring") as step:
            m = get_compression_metrics(input, config=cfg, sparsity=sparsity, lz4=lz4,
                                        thresholds=Thresholds(max_rmse, min_snr, min_cosine), progress=step)
        if plot is not None:
            from kvcx.quality.plots import snr_heatmap

            snr_heatmap(input, cfg, plot, n_threads=threads)
            if not json_out:
                err.print(f"[green]heatmap[/] → {escape(str(plot))}")
    report_metrics(m, json_out, f"kvcx metrics: {input}", check=True)


@app.command()
def info(json_out: JsonOpt = False):
    """Show which kernels run (the variant chosen for this CPU) and how they were built: OpenMP, threads, SIMD."""
    with cli_errors("info"):
        from kvcx.codecs.runtime import build_info

        i = build_info()
    i["version"] = __version__
    if json_out:
        emit_json(i)
        return
    t = Table(title="kvcx build", header_style="bold")
    t.add_column("item")
    t.add_column("value")
    for k in ("version", "kernels", "kernels_built", "kernels_forced", "openmp", "max_threads", "threads_used",
              "omp_num_threads_env", "simd", "f16c_kernels"):
        v = i[k]
        t.add_row(k, " ".join(v) if isinstance(v, list) else str(v))
    out.print(t)


