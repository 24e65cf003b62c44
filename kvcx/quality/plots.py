"""Pictures (matplotlib, an optional extra: ``pip install kvcx[plot]``): the per-layer x per-head error
heatmap of ``kvcx metrics --plot`` (:func:`snr_heatmap`) and the bits/value vs perplexity-delta Pareto chart
of ``bench/bench_quality.py``. The drawing functions return PNG bytes; :func:`snr_heatmap` writes its file
atomically."""
from __future__ import annotations

import io
import os
import textwrap
from typing import Iterable, Optional

import numpy as np

from kvcx.codecs.dtypes import dtype_name
from kvcx.codecs.kvconfig import KVConfig, is_key_tensor, layer_of
from kvcx.codecs.metrics import error_stats
from kvcx.errors import FormatError, KvcxError


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise KvcxError("drawing pictures needs matplotlib: pip install 'kvcx[plot]'") from None
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight", metadata={"Software": None})
    _pyplot().close(fig)
    return buf.getvalue()


def heatmap_png(grids: dict, title: str = "") -> bytes:
    """Keys and values side by side: SNR (dB) per layer (rows) x KV head (columns), one shared colour scale."""
    plt = _pyplot()
    kinds = [k for k in ("key", "value") if k in grids]
    finite = np.concatenate([g[np.isfinite(g)].ravel() for _, g in (grids[k] for k in kinds)])
    lo, hi = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 1.0)
    n_layers = max(len(grids[k][0]) for k in kinds)
    width = max(6.5, 2.2 + len(kinds) * (1.6 + 0.25 * max(g.shape[1] for _, g in grids.values())))
    fig, axes = plt.subplots(1, len(kinds), figsize=(width, 1.6 + 0.22 * n_layers), squeeze=False)
    im = None
    for ax, kind in zip(axes[0], kinds):
        layers, grid = grids[kind]
        im = ax.imshow(grid, aspect="auto", cmap="viridis", vmin=lo, vmax=hi, interpolation="nearest")
        ax.set_title(f"{kind}s")
        ax.set_xlabel("KV head")
        ax.set_xticks(range(grid.shape[1]))
        step = max(1, len(layers) // 16)
        ax.set_yticks(range(0, len(layers), step))
        ax.set_yticklabels([str(layers[i]) for i in range(0, len(layers), step)])
    axes[0][0].set_ylabel("layer")
    fig.colorbar(im, ax=list(axes[0]), label="SNR (dB), higher is better")
    if title:   # above the panels' own titles (0.4 in over the axes' top), never over them; the tight bbox keeps it
        fig.suptitle("\n".join(textwrap.wrap(title, 110)[:4]), fontsize=7, va="bottom",
                     y=fig.subplotpars.top + 0.4 / fig.get_size_inches()[1])
    return _png(fig)


def pareto_png(points: Iterable[dict], thresholds: Iterable[tuple] = ((0.5, "0.5 (KVQuant, validate default)"),
                                                                       (0.3, "0.3 (users' CI threshold)")),
               title: Optional[str] = None) -> bytes:
    """Bits/value (x) vs perplexity delta (log y); ``points``: dicts with bits, delta, label and kind
    ("kvcx", "peer", "engine": an engine's KV format as kvcx emulates it, or "dropped": a candidate measured and not
    shipped).
    Settings whose delta is <= 0 are drawn at the axis floor (a log scale has no room for them)."""
    return _png(pareto_figure(points, thresholds, title))


def pareto_figure(points: Iterable[dict], thresholds: Iterable[tuple], title: Optional[str] = None):
    """:func:`pareto_png`'s figure, every label placed (:func:`place_labels`)."""
    plt = _pyplot()
    pts = list(points)
    pos = [p["delta"] for p in pts if p["delta"] > 0]
    floor = min(pos) / 2 if pos else 1e-3
    fig, ax = plt.subplots(figsize=(8.5, 5.5))
    labels = []
    for kind, colour, marker, name in (("kvcx", "tab:blue", "o", "kvcx"), ("peer", "tab:red", "s", "peers"),
                                       ("engine", "tab:green", "^", "engine formats (kvcx's byte-exact emulations)"),
                                       ("dropped", "tab:grey", "x", "kvcx candidates not shipped")):
        sel = [p for p in pts if p.get("kind", "kvcx") == kind]
        if not sel:
            continue
        ax.scatter([p["bits"] for p in sel], [max(p["delta"], floor) for p in sel], c=colour, marker=marker,
                   label=name, zorder=3)
        labels += [(p["bits"], max(p["delta"], floor), p["label"], colour) for p in sel]
    notes = []
    for y, text in thresholds:
        ax.axhline(y, ls="--", lw=0.8, color="grey")
        # at the right end, under the line: the low-bit points sit at the left, near these thresholds
        notes.append(ax.text(max(p["bits"] for p in pts), y / 1.07, text, fontsize=7, color="grey", ha="right",
                             va="top"))
    ax.set_yscale("log")
    ax.set_xlabel("bits per value (everything stored)")
    ax.set_ylabel("perplexity delta vs the exact cache (log)")
    ax.grid(True, which="both", lw=0.3, alpha=0.5)
    ax.legend(loc="upper right")
    if title:
        ax.set_title(title, fontsize=9)
    fig.tight_layout()   # the axes' final place, so the labels' boxes are measured where they will be drawn
    place_labels(ax, labels, avoid=notes)
    return fig


def head_snr_grid(original: dict, decoded: dict, n_threads: Optional[int] = None) -> dict:
    """SNR (dB) per layer x KV head, keys and values apart: ``{"key": (layers, grid), "value": (layers, grid)}``
    with ``grid[i, h]`` the SNR of layer ``layers[i]``'s head ``h`` (axis -3 of a [..., heads, tokens, head_dim]
    tensor). Tensors whose name carries no layer index are left out."""
    rows: dict = {"key": {}, "value": {}}
    for name, a in original.items():
        layer = layer_of(name)
        if layer is None or name not in decoded or np.asarray(a).ndim < 3:
            continue
        a, b = np.asarray(a), np.asarray(decoded[name])
        heads = a.shape[-3]
        snr = []
        for h in range(heads):
            s = error_stats(np.ascontiguousarray(a[..., h, :, :]), np.ascontiguousarray(b[..., h, :, :]),
                            name=f"{name}[head {h}]", n_threads=n_threads)
            snr.append(min(s.snr_db, 99.0))   # exact heads (infinite SNR) drawn at the top of the scale
        rows["key" if is_key_tensor(name) else "value"][layer] = snr
    out = {}
    for kind, by_layer in rows.items():
        if not by_layer:
            continue
        width = max(len(v) for v in by_layer.values())
        layers = sorted(by_layer)
        grid = np.full((len(layers), width), np.nan)
        for i, L in enumerate(layers):
            grid[i, :len(by_layer[L])] = by_layer[L]
        out[kind] = (layers, grid)
    return out


def snr_heatmap(input_path, config: KVConfig, output_path, n_threads: Optional[int] = None) -> dict:
    """Compress ``input_path`` in memory and draw its per-layer x per-head SNR (keys | values) to a PNG,
    written atomically. Returns the grids (see :func:`head_snr_grid`)."""
    from kvcx.api import open_plain
    from kvcx.formats.atomic import OutputSet, check_distinct, write_bytes_to
    from kvcx.formats.packed import compress_tensors, decompress_tensors

    with open_plain(input_path) as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    out, meta, _ = compress_tensors(tensors, config)
    decoded = decompress_tensors(out, meta, n_threads=n_threads)
    grids = head_snr_grid({k: v for k, v in tensors.items() if k in decoded and dtype_name(v.dtype)}, decoded,
                          n_threads=n_threads)
    if not grids:
        raise FormatError(f"{input_path}: no tensor name carries a layer index (layer_<i>_key, past_key_values.<i>.0"
                          ", layers.<i>...) with [.., heads, tokens, head_dim] shape; --plot needs them")
    png = heatmap_png(grids, title=f"{os.path.basename(os.fspath(input_path))}: {config.describe()}")
    check_distinct([input_path], [output_path])
    with OutputSet([output_path]) as tmp:
        write_bytes_to(tmp[os.fspath(output_path)], os.fspath(output_path), [png])
    return grids


def validation_pareto(results, output_path, title: Optional[str] = None) -> None:
    """`kvcx validate --pareto`: bits/value vs perplexity delta of every validated setting, with the threshold,
    written atomically to a PNG."""
    from kvcx.formats.atomic import OutputSet, write_bytes_to

    results = list(results)
    pts = [{"bits": r.bits_per_value, "delta": r.delta, "label": r.setting,
            "kind": "kvcx" if r.config.get("key", {}).get("id", "kvcx.int").startswith("kvcx") else "peer"}
           for r in results]
    png = pareto_png(pts, thresholds=((results[0].threshold, f"threshold {results[0].threshold}"),), title=title)
    with OutputSet([output_path]) as tmp:
        write_bytes_to(tmp[os.fspath(output_path)], os.fspath(output_path), [png])


def place_labels(ax, labels, fontsize: float = 6.5, avoid=()) -> None:
    """Each (x, y, text, colour) written beside its point where it overlaps no label already written, no other
    point and no artist of ``avoid`` (a threshold's note), and stays in the axes: tried right and left of the point,
    then further above and below it (joined to the point by a thin line); a label with no free place takes its
    first. The legend counts as written."""
    from matplotlib.transforms import Bbox
    from matplotlib.text import Text

    renderer = ax.figure.canvas.get_renderer()
    frame = ax.get_window_extent(renderer)
    offsets = [(5, 3), (5, -10), (-5, 3), (-5, -10)]
    for k in range(1, 12):
        offsets += [(5, 3 + 8 * k), (5, -10 - 8 * k), (-5, 3 + 8 * k), (-5, -10 - 8 * k)]
    legend = ax.get_legend()
    placed = [legend.get_window_extent(renderer)] if legend is not None else []
    placed += [a.get_window_extent(renderer) for a in avoid]
    # each point's marker (a few pixels each way), which no other point's label may cover
    at = ax.transData.transform([(x, y) for x, y, _, _ in labels]) if labels else []
    r = 3.5 * ax.figure.dpi / 72
    marks = [Bbox.from_extents(px - r, py - r, px + r, py + r) for px, py in at]
    order = sorted(range(len(labels)), key=lambda i: (-labels[i][1], labels[i][0]))
    for i in order:
        x, y, text, colour = labels[i]
        others = [m for j, m in enumerate(marks) if j != i]
        chosen = None
        for dx, dy in offsets:
            far = abs(dy) > 10
            t = ax.annotate(text, (x, y), fontsize=fontsize, xytext=(dx, dy), textcoords="offset points",
                            color=colour, ha="left" if dx > 0 else "right",
                            arrowprops=dict(arrowstyle="-", lw=0.3, color=colour) if far else None)
            t.update_positions(renderer)
            box = Text.get_window_extent(t, renderer)   # the words alone, not the line to the point
            inside = frame.x0 <= box.x0 and box.x1 <= frame.x1 and frame.y0 <= box.y0 and box.y1 <= frame.y1
            if inside and not any(box.overlaps(b) for b in placed + others):
                chosen = box
                break
            t.remove()
        if chosen is None:   # crowded: the first place, overlapping
            t = ax.annotate(text, (x, y), fontsize=fontsize, xytext=offsets[0], textcoords="offset points",
                            color=colour)
            chosen = t.get_window_extent(renderer)
        placed.append(chosen)


def retrieval_pareto_png(points: Iterable[dict], title: Optional[str] = None) -> bytes:
    """Bits per value-equivalent (x, log 2) vs retrieval accuracy (y) of each setting; ``points``: dicts with bits,
    accuracy, label and kind ("exact", "quantization", "eviction", "both" or "calibrated"), one colour each."""
    plt = _pyplot()
    pts = list(points)
    fig, ax = plt.subplots(figsize=(8.5, 5.5))
    colours = {}
    for kind, colour, marker in (("exact", "black", "*"), ("quantization", "tab:blue", "o"),
                                 ("eviction", "tab:orange", "s"), ("both", "tab:green", "D"),
                                 ("calibrated", "tab:red", "P")):
        colours[kind] = colour
        sel = [p for p in pts if p["kind"] == kind]
        if not sel:
            continue
        ax.scatter([p["bits"] for p in sel], [100 * p["accuracy"] for p in sel], c=colour, marker=marker, label=kind,
                   zorder=3)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("bits per value-equivalent of the context (everything held: codes, scales, kept positions)")
    ax.set_ylabel("prompts answered, % (kept tasks)")
    ax.set_ylim(-3, 103)
    ax.grid(True, which="both", lw=0.3, alpha=0.5)
    ax.legend(loc="lower right")
    if title:
        ax.set_title(title, fontsize=9)
    fig.tight_layout()   # the axes' final place, so the labels' boxes are measured where they will be drawn
    place_labels(ax, [(p["bits"], 100 * p["accuracy"], p["label"], colours.get(p["kind"], "black")) for p in pts])
    return _png(fig)
