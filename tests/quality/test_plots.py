"""kvcx metrics --plot: the per-layer x per-head SNR heatmap."""
import json

import numpy as np
import pytest

from kvcx.formats import safetensors as kst
from kvcx.formats.packed import compress_tensors, decompress_tensors
from kvcx.quality.plots import head_snr_grid

from helpers import plan_config, run, tinyllama_cache


def test_metrics_plot_draws_the_per_head_heatmap(cache128, tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib.image as mpimg

    png = tmp_path / "heat.png"
    r = run("metrics", cache128, "--scheme", "kvcx2", "--plot", png, "--json", "--min-snr", "0", "--max-rmse", "10",
            "--min-cosine", "0")
    assert r.exit_code == 0, r.output
    json.loads(r.stdout)  # --json keeps stdout machine-readable
    img = mpimg.imread(png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and img.shape[0] > 100 and img.shape[1] > 200
    tensors = tinyllama_cache(seq=128)
    grids = head_snr_grid(tensors, decompress_tensors(*compress_tensors(tensors, plan_config())[:2]))
    layers, grid = grids["key"]
    assert layers == list(range(22)) and grid.shape == (22, 4) and np.isfinite(grid).all()
    # layer 2's keys are 4-bit in the plan: every head better than layer 0's 3-bit keys
    assert (grid[2] > grid[0] + 3).all()
    # names without a layer index: a clear error
    flat = tmp_path / "flat.safetensors"
    kst.save_file({"k": tensors["layer_0_key"], "v": tensors["layer_0_value"]}, flat)
    r = run("metrics", flat, "--plot", tmp_path / "x.png")
    assert r.exit_code == 1 and "layer index" in r.output
    r = run("metrics", cache128, "--plot", tmp_path / "no" / "x.png")
    assert r.exit_code == 1 and "does not exist" in r.output and "Traceback" not in r.output


def test_retrieval_pareto_draws_every_kind(tmp_path):
    pytest.importorskip("matplotlib")
    import io

    import matplotlib.image as mpimg

    from kvcx.quality.plots import retrieval_pareto_png

    points = [{"bits": 16.0, "accuracy": 1.0, "label": "exact", "kind": "exact"},
              {"bits": 4.4, "accuracy": 0.95, "label": "kvcx", "kind": "quantization"},
              {"bits": 8.06, "accuracy": 0.4, "label": "snapkv:0.5", "kind": "eviction"},
              {"bits": 2.3, "accuracy": 0.35, "label": "kvcx+snapkv:0.5", "kind": "both"},
              {"bits": 1.0, "accuracy": 0.5, "label": "plan-1.0", "kind": "calibrated"}]
    png = retrieval_pareto_png(points, title="t")
    img = mpimg.imread(io.BytesIO(png), format="png")
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and img.shape[0] > 100 and img.shape[1] > 200


def test_labels_of_points_at_the_same_place_do_not_overlap():
    """Settings at the same accuracy and bits (several presses answer 0 % at 2.26 bits) each get a label of their
    own, none over another or the legend, all inside the axes."""
    pytest.importorskip("matplotlib")
    from matplotlib.text import Text

    from kvcx.quality.plots import _pyplot, place_labels

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8.5, 5.5))
    xs = [2.26, 2.26, 2.26, 2.3, 4.03, 4.03, 16.0, 1.0, 2.0]
    ys = [0, 0, 0, 0, 0, 0, 100, 100, 100]
    ax.scatter(xs, ys, label="points")
    ax.set_xscale("log", base=2)
    ax.set_ylim(-3, 103)
    ax.legend(loc="lower right")
    fig.tight_layout()
    place_labels(ax, [(x, y, f"setting-{i}:0.25", "black") for i, (x, y) in enumerate(zip(xs, ys))])
    renderer = fig.canvas.get_renderer()
    boxes = []
    for t in ax.texts:
        t.update_positions(renderer)
        boxes.append(Text.get_window_extent(t, renderer))
    frame = ax.get_window_extent(renderer)
    legend = ax.get_legend().get_window_extent(renderer)
    plt.close(fig)
    assert len(boxes) == len(xs)
    for i, a in enumerate(boxes):
        assert frame.x0 <= a.x0 and a.x1 <= frame.x1 and frame.y0 <= a.y0 and a.y1 <= frame.y1
        assert not a.overlaps(legend)
        assert not any(a.overlaps(b) for b in boxes[i + 1:])


@pytest.mark.parametrize("n_layers", [2, 30])
def test_the_heatmaps_title_sits_above_the_panel_titles(monkeypatch, n_layers):
    """The figure's title (up to four wrapped lines) never covers the 'keys' / 'values' titles, short figure or tall."""
    pytest.importorskip("matplotlib")
    import kvcx.quality.plots as plots

    figs = []
    monkeypatch.setattr(plots, "_png", lambda fig: figs.append(fig) or b"")
    rng = np.random.default_rng(0)
    grids = {k: (list(range(n_layers)), rng.uniform(10, 30, (n_layers, 3))) for k in ("key", "value")}
    plots.heatmap_png(grids, "a long title " * 30)
    (fig,) = figs
    r = fig.canvas.get_renderer()
    top = fig._suptitle.get_window_extent(r)
    assert len(fig._suptitle.get_text().splitlines()) == 4
    for ax in fig.axes[:2]:
        assert ax.title.get_window_extent(r).y1 < top.y0      # wholly below the figure title


def test_the_pareto_charts_labels_cover_no_label_point_or_threshold_note():
    """bench_quality's chart (docs/pareto.png) crowds settings at about the same bits and delta, some on a threshold:
    each label sits clear of the others, of every other point and of the thresholds' notes, inside the axes."""
    pytest.importorskip("matplotlib")
    from matplotlib.text import Text

    from kvcx.quality.plots import _pyplot, pareto_figure

    pts = [{"bits": b, "delta": d, "label": f"setting {i} of a long name", "kind": k}
           for i, (b, d, k) in enumerate([(3.26, 0.48, "peer"), (3.5, 0.68, "peer"), (3.5, 0.66, "kvcx"),
                                          (3.38, 0.53, "engine"), (3.43, 0.34, "kvcx"), (4.25, 0.52, "kvcx"),
                                          (4.25, 0.58, "engine"), (4.5, 0.29, "engine"), (4.5, 0.27, "engine"),
                                          (4.5, 0.13, "peer"), (4.5, 0.12, "peer"), (2.5, 60.0, "peer"),
                                          (4.63, 0.016, "kvcx"), (4.35, 0.024, "kvcx"), (4.43, 0.026, "kvcx")])]
    fig = pareto_figure(pts, ((0.5, "0.5 (KVQuant, validate default)"), (0.3, "0.3 (users' CI threshold)")), "t")
    ax = fig.axes[0]
    renderer = fig.canvas.get_renderer()
    notes = [t for t in ax.texts if t.get_text().startswith(("0.5 (", "0.3 ("))]
    labels = [t for t in ax.texts if t not in notes]
    assert len(notes) == 2 and sorted(t.get_text() for t in labels) == sorted(p["label"] for p in pts)
    boxes = []
    for t in labels:
        t.update_positions(renderer)
        boxes.append(Text.get_window_extent(t, renderer))
    frame = ax.get_window_extent(renderer)
    walls = [ax.get_legend().get_window_extent(renderer)] + [t.get_window_extent(renderer) for t in notes]
    points = ax.transData.transform([(p["bits"], p["delta"]) for p in pts])
    _pyplot().close(fig)
    for i, a in enumerate(boxes):
        assert frame.x0 <= a.x0 and a.x1 <= frame.x1 and frame.y0 <= a.y0 and a.y1 <= frame.y1
        assert not any(a.overlaps(b) for b in walls + boxes[i + 1:])
        mine = next(j for j, p in enumerate(pts) if p["label"] == labels[i].get_text())
        # no other point's centre under a label (markers a few pixels wide: their boxes are kept clear too)
        assert not any(a.contains(*xy) for j, xy in enumerate(points) if j != mine)
