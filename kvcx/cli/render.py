"""What the ``kvcx`` command line prints: rich tables, progress bars and colours (the library reports through
callbacks and returns results; only this package renders)."""
from __future__ import annotations

import json
import sys
from contextlib import contextmanager

from rich.console import Console
from rich.markup import escape
from rich.table import Table

out = Console(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else 120)
err = Console(stderr=True, highlight=False, soft_wrap=True)


def emit_json(obj) -> None:
    from kvcx.codecs.metrics import json_safe

    sys.stdout.write(json.dumps(json_safe(obj), indent=2) + "\n")
    sys.stdout.flush()


@contextmanager
def progress(total: int, label: str, quiet: bool = False):
    """A rich progress bar on stderr; yields a callback that advances it by one."""
    if quiet or total == 0 or not err.is_terminal:  # a bar drawn into a pipe or log is noise (and a stray newline)
        yield lambda *_: None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=err, transient=True) as p:
        task = p.add_task(label, total=total)
        yield lambda *_: p.advance(task)


REFERENCE_LEVEL = "reference level (absolute RMSE, TinyLlama scale)"


def metrics_table(m, title: str) -> Table:
    t = Table(title=title, show_header=True, header_style="bold")
    t.add_column("metric")
    t.add_column("value", justify="right")
    rows = [
        ("compression ratio vs FP16", f"{m.compression_ratio:.2f}x"),
        ("bits / value", f"{m.bits_per_value:.3f}"),
        ("original size", f"{m.original_size_bytes:,} B ({m.file_size_ratio:.2f}x as stored)"),
        ("compressed size", f"{m.compressed_size_bytes:,} B"),
        ("relative RMSE (RMSE / RMS)", f"{m.relative_rmse:.4f}"),
        ("SNR", f"{m.snr_db:.2f} dB"),
        ("cosine similarity", f"{m.cosine_similarity:.6f}"),
        ("RMSE (absolute)", f"{m.rmse:.5f}"),
        ("max abs error", f"{m.max_error:.5f}"),
        (REFERENCE_LEVEL, m.quality_level),
        ("processing time", f"{m.processing_time_ms:.1f} ms"),
    ]
    for r in rows:
        t.add_row(*r)
    return t


def tensor_table(m, limit: int = 12) -> Table:
    t = Table(title="per tensor", header_style="bold")
    for c in ("tensor", "shape", "dtype", "codec", "rel. RMSE", "SNR dB", "RMSE", "cosine", "max err"):
        t.add_column(c, justify="left" if c in ("tensor", "shape", "dtype", "codec") else "right")
    for tm in m.tensors[:limit]:
        t.add_row(tm.name, "x".join(map(str, tm.shape)), tm.dtype, tm.codec, f"{tm.relative_rmse:.4f}",
                  f"{tm.snr_db:.2f}", f"{tm.rmse:.5f}", f"{tm.cosine_similarity:.6f}", f"{tm.max_error:.4f}")
    if len(m.tensors) > limit:
        t.add_row(f"... {len(m.tensors) - limit} more", "", "", "", "", "", "", "", "")
    return t


def print_phase(step: int, total: int, message: str) -> None:
    out.print(f"[bold][{step}/{total}][/] {escape(message)}")


@contextmanager
def window_bar(quiet: bool, label: str = "windows"):
    """A transient progress bar over the evaluation windows (or prompts), on stderr; yields the callback. Not on
    a terminal (CI, a log file): a plain line at each tenth of the work, so a long run is never silent."""
    if quiet:
        yield None
        return
    if not err.is_terminal:
        yield _progress_lines(label)
        return
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    prog = Progress(TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TimeRemainingColumn(), console=err, transient=True)
    task = None

    def on_window(done: int, total: int) -> None:
        nonlocal task
        if task is None:
            prog.start()
            task = prog.add_task("windows", total=total)
        prog.update(task, completed=done)
        if done >= total:
            prog.stop()

    try:
        yield on_window
    finally:
        prog.stop()


def print_validation(r) -> None:
    """The verdict first (perplexity decides), then the figures behind it."""
    style = "bold green" if r.passed else "bold red"
    out.print(f"[{style}]{escape(r.verdict_line())}[/]")
    t = Table(title="RESULTS", header_style="bold")
    t.add_column("metric")
    t.add_column("value", justify="right")
    if not r.quick_test:
        t.add_row("perplexity delta (the verdict)", f"{r.delta:+.4f} ({r.delta_percent:+.3f}%), threshold {r.threshold}")
        t.add_row("baseline perplexity", f"{r.baseline_perplexity:.4f}")
        t.add_row("compressed perplexity", f"{r.compressed_perplexity:.4f}")
        t.add_row("next-token KL divergence", f"{r.kld:.5f} nats / token")
        t.add_row("top-1 agreement", f"{100 * r.top1_agreement:.2f}%")
        t.add_row("tokens scored", f"{r.tokens_scored:,} in {r.windows} windows ({r.mode} mode)")
    t.add_row("compression ratio vs FP16", f"{r.compression_ratio:.2f}x")
    t.add_row("bits / value", f"{r.bits_per_value:.3f}")
    if r.cache_dtype and r.cache_dtype != "float16":
        t.add_row(f"compression ratio vs the {r.cache_dtype} cache", f"{r.compression_ratio_vs_cache_dtype:.2f}x")
    if r.mode == "prefix" or r.quick_test:
        t.add_row("relative RMSE (RMSE / RMS)", f"{r.relative_rmse:.4f}")
        t.add_row("SNR", f"{r.snr_db:.2f} dB")
        t.add_row("cosine similarity", f"{r.cosine_similarity:.6f}")
        t.add_row("RMSE (absolute)", f"{r.rmse:.5f}")
        t.add_row(REFERENCE_LEVEL, r.quality_level)
    if r.backend:
        t.add_row("kernels", f"{r.backend} ({r.device})" if r.device else r.backend)
    t.add_row("wall time", f"{r.wall_time_s:.1f} s (codec {r.codec_time_s:.2f} s)")
    out.print(t)


def print_validations(results, gated, quiet: bool) -> None:
    """Several settings on the same tokens: one row each, the verdicts that gate the exit code marked."""
    r0, failed = results[0], [r.setting for r in results if not r.passed and r.setting in gated]
    out.print(f"[bold red]FAILED: {escape(', '.join(failed))} at or above threshold {r0.threshold}[/]" if failed else
              f"[bold green]PASSED: every gated setting below threshold {r0.threshold}[/]")
    if quiet:
        return
    t = Table(title=escape("quick test (no model)" if r0.quick_test else
                           f"{r0.model}: baseline perplexity {r0.baseline_perplexity:.4f}, {r0.tokens_scored:,} tokens "
                           f"in {r0.windows} windows of {r0.window} ({r0.mode} mode)"), header_style="bold")
    for col in ("setting", "bits/value", "vs FP16", "delta", "KLD", "top-1", "kernels", "verdict"):
        t.add_column(col, justify="left" if col in ("setting", "kernels", "verdict") else "right")
    for r in results:
        figures = ["-"] * 3 if r.quick_test else [f"{r.delta:+.4f}", f"{r.kld:.5f}", f"{100 * r.top1_agreement:.2f}%"]
        t.add_row(escape(r.setting), f"{r.bits_per_value:.3f}", f"{r.compression_ratio:.2f}x", *figures,
                  r.backend or "-",
                  ("[green]PASS[/]" if r.passed else "[red]FAIL[/]") + ("" if r.setting in gated else " (not gated)"))
    out.print(t)
    out.print(f"wall time {r0.wall_time_s:.1f} s")


def print_retrieval(results, gated, quiet: bool) -> None:
    """The retrieval table: per task and length, prompts answered with the exact cache and with every setting
    (accuracy and its 95 % interval; red where the paired test puts a setting below the exact cache)."""
    r0 = results[0]
    failed = [r.setting for r in results if not r.passed and r.setting in gated]
    if failed:
        out.print(f"[bold red]FAILED: {escape(', '.join(failed))}: significantly below the exact cache on some task "
                  f"and length (alpha {r0.alpha}), or no task kept[/]")
        codecs = [r for r in results if r.setting in failed and "press" not in (r.config or {})]
        if codecs:   # a press drops tokens: more bits in the keys kept cannot bring them back
            out.print(f"[yellow]a codec that loses retrieval at long contexts may lose it in a few layers' keys: "
                      f"`kvcx calibrate --guard-retrieval {max(r0.lengths)} --scheme SCHEME --out guard.json` gives them "
                      "8 bits; gate it with --plan guard.json[/]")
    else:
        out.print(f"[bold green]PASSED: no gated setting significantly below the exact cache on any kept task and "
                  f"length (alpha {r0.alpha}, McNemar's exact test, Holm-adjusted)[/]")
    if quiet:
        for r in results:
            out.print(escape(r.verdict_line()))
        return
    depths = ", ".join(f"{100 * d:g}" for d in r0.depths)
    t = Table(title=escape(f"{r0.model}: {r0.task}, prompts answered ({r0.prompts} per depth at depths {depths} %; "
                           "95 % Wilson interval)"), header_style="bold")
    t.add_column("task")
    t.add_column("context", justify="right")
    t.add_column("exact cache", justify="right")
    for r in results:
        t.add_column(escape(f"{r.setting} ({r.bits_per_value:.2f} b/v)"), justify="right")
    for i, c0 in enumerate(r0.cells):
        cells = []
        for r in results:
            c = r.cells[i]
            text = f"{c.correct}/{c.prompts} ({100 * c.ci_low:.0f}-{100 * c.ci_high:.0f} %)"
            style = "red" if c.kept and c.p_adjusted < r.alpha else ("dim" if not c.kept else "")
            cells.append(f"[{style}]{text}[/]" if style else text)
        task = c0.task + ("" if c0.kept else " (dropped)")
        t.add_row(escape(task), f"{c0.length:,}", f"{c0.exact_correct}/{c0.prompts}", *cells)
    t.add_row("verdict", "", "", *[("[green]PASS[/]" if r.passed else "[red]FAIL[/]") + f" p={r.p_value:.2g}" +
                                   ("" if r.setting in gated else " (not gated)") for r in results])
    out.print(t)
    for task, why in r0.dropped.items():
        out.print(f"dropped {escape(task)}: {escape(why)}")
    out.print(f"wall time {r0.wall_time_s:.1f} s")


def _progress_lines(label: str):
    """The callback of :func:`window_bar` off a terminal: ``label done/total (elapsed)`` lines on stderr, about ten
    a run (every item when there are ten or fewer)."""
    import time

    start = time.perf_counter()

    def on_item(done: int, total: int) -> None:
        if done == total or done % max(1, total // 10) == 0:
            s = int(time.perf_counter() - start)
            err.print(f"{label} {done}/{total} ({s // 60}m {s % 60:02d}s)", markup=False)

    return on_item
