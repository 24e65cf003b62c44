"""``kvcx calibrate``: per-layer bit widths from the model's measured sensitivity.

Layers are not equally fragile: on SmolLM2-135M, 2-bit keys in layer 18 cost 2,000x the KL divergence of
2-bit keys in layer 0, and 6 of the 60 (layer, keys/values) pairs carry 70 % of the total. Calibration measures it: for every layer and for keys and values apart,
only that layer's keys (or values) go through the low-bit codec, everything else stays exact, and the
mean KL divergence of the next-token distributions from the exact model's is that layer's sensitivity.
:func:`allocate` then spends a bit budget where it buys the most: starting from the config's widths, it
raises one layer's keys or values by one bit at a time, the step with the largest estimated KLD saved per
bit/value spent (each extra bit cutting the error energy about 4x), until the budget is used.

The calibration text comes from windows *after* the ones ``kvcx validate`` and ``bench/bench_quality.py``
score (``offset``, default 128 windows of 512), so a plan is never judged on the tokens that chose it.
This module computes; it prints nothing. torch is imported inside the functions that need it.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

from kvcx.errors import KvcxError
from kvcx.kvconfig import KVConfig, layer_of

DEFAULT_WINDOWS = 4
DEFAULT_OFFSET = 128      # windows skipped: validate scores the first 32, bench_quality the first 64
MAX_BITS = 4              # widths the allocator may raise a layer to


@dataclass
class Calibration:
    config: KVConfig                                   # the plan: the base config with per-layer widths
    sensitivity: Dict[Tuple[str, int], float]          # (kind, layer) -> mean KLD at the base width, nats/token
    budget: float
    bits_per_value: float                              # the plan's nominal bits/value
    n_layers: int
    windows: int
    tokens: int
    wall_time_s: float = 0.0
    model: str = ""
    steps: List[Tuple[str, int, int]] = field(default_factory=list)   # (kind, layer, new bits) in order taken

    def to_dict(self) -> dict:
        return {"config": self.config.get_config(), "budget": self.budget, "bits_per_value": self.bits_per_value,
                "n_layers": self.n_layers, "windows": self.windows, "tokens": self.tokens, "model": self.model,
                "wall_time_s": self.wall_time_s,
                "sensitivity": [{"kind": k, "layer": L, "kld": v} for (k, L), v in sorted(self.sensitivity.items())],
                "steps": [list(s) for s in self.steps]}


def _one_layer_roundtrip(config: KVConfig, kind: str, layer: int):
    """Round trip that compresses only ``layer``'s keys or values (the rest stays exact)."""
    from kvcx.kv_cache import roundtrip_tensors
    from kvcx.kvconfig import is_key_tensor

    def rt(tensors):
        pick = {n: a for n, a in tensors.items()
                if layer_of(n) == layer and is_key_tensor(n) == (kind == "key")}
        if not pick:
            raise KvcxError(f"calibration: the cache has no {kind} tensor for layer {layer}")
        decoded, nbytes, stats = roundtrip_tensors(pick, config)
        return {**tensors, **decoded}, nbytes, stats
    return rt


def layer_sensitivity(model, ids, starts: List[int], window: int, stride: int, config: KVConfig, n_layers: int,
                      on_window: Optional[Callable[[int, int], None]] = None) -> Tuple[Dict[Tuple[str, int], float], int]:
    """({(kind, layer): mean KLD}, tokens scored) with one layer's keys or values compressed at a time."""
    from kvcx.validation import compare_prefix

    roundtrips = {(kind, L): _one_layer_roundtrip(config, kind, L) for L in range(n_layers) for kind in ("key", "value")}
    runs = compare_prefix(model, ids, starts, window, stride, roundtrips, on_window)
    tokens = next(iter(runs.values())).tokens
    return {k: r.mean_kld for k, r in runs.items()}, tokens


def allocate(sensitivity: Dict[Tuple[str, int], float], config: KVConfig, n_layers: int,
             budget: float) -> Tuple[KVConfig, List[Tuple[str, int, int]]]:
    """Per-layer widths within ``budget`` nominal bits/value (keys and values of every layer the same size).

    Greedy: every step raises the (kind, layer) whose next bit saves the most estimated KLD per bit/value,
    with the KLD at width b estimated as ``sensitivity * 4 ** -(b - base bits)``."""
    base = {"key": config.key, "value": config.value}
    base_bpv = (config.key.bits_per_value() + config.value.bits_per_value()) / 2
    if not math.isfinite(budget) or budget < base_bpv:
        raise KvcxError(f"--budget {budget} bits/value is below the base config's {base_bpv:.3f}; raise it or pick a "
                        "scheme with fewer bits (kvcx2, kvcx3)")
    bits = {(k, L): base[k].bits for L in range(n_layers) for k in base}
    per_value = {k: base[k].bits_per_value() - base[k].bits for k in base}   # scale/zero overhead per value
    total = sum(bits[i] + per_value[i[0]] for i in bits)
    budget_total = budget * len(bits)
    steps = []
    while True:
        best, best_gain = None, 0.0
        for (k, L), b in bits.items():
            if b >= MAX_BITS or total + 1 > budget_total + 1e-9:
                continue
            s = max(sensitivity.get((k, L), 0.0), 0.0)
            gain = s * (4.0 ** -(b - base[k].bits)) * 0.75   # KLD(b) - KLD(b + 1)
            if gain > best_gain:
                best, best_gain = (k, L), gain
        if best is None:
            break
        bits[best] += 1
        total += 1
        steps.append((best[0], best[1], bits[best]))
    layer_bits = [(L, bits[("key", L)], bits[("value", L)]) for L in range(n_layers)
                  if (bits[("key", L)], bits[("value", L)]) != (base["key"].bits, base["value"].bits)]
    return KVConfig(key=config.key, value=config.value, scheme=config.scheme, layer_bits=layer_bits), steps


def reallocate(saved: dict, budget: float, source: str = "<plan>") -> Calibration:
    """A new plan from the sensitivities an earlier calibration measured (a plan file's JSON): one
    measurement, any number of budgets. The base config is the saved plan's without its per-layer widths."""
    try:
        cfg = KVConfig.from_config(saved["config"])
        sens = {(r["kind"], int(r["layer"])): float(r["kld"]) for r in saved["sensitivity"]}
        n_layers = int(saved["n_layers"])
    except (KeyError, TypeError, ValueError) as exc:
        raise KvcxError(f"{source}: not a plan written by `kvcx calibrate` (missing or bad field: {exc}); "
                        "calibrate again") from None
    if set(sens) != {(k, L) for L in range(n_layers) for k in ("key", "value")}:
        raise KvcxError(f"{source}: the plan's sensitivities do not cover keys and values of its {n_layers} layers; "
                        "calibrate again")
    base = KVConfig(key=cfg.key, value=cfg.value, scheme=cfg.scheme)
    plan, steps = allocate(sens, base, n_layers, budget)
    return Calibration(config=plan, sensitivity=sens, budget=budget, bits_per_value=plan.bits_per_value(n_layers),
                       n_layers=n_layers, windows=int(saved.get("windows", 0)), tokens=int(saved.get("tokens", 0)),
                       model=str(saved.get("model", "")), steps=steps)


def run_calibration(config: KVConfig, budget: float, model: Optional[str] = None, dataset_file=None,
                    windows: int = DEFAULT_WINDOWS, offset: int = DEFAULT_OFFSET, window: int = 1024,
                    stride: int = 512, cpu: bool = False, loaded=None,
                    on_phase: Optional[Callable[[int, int, str], None]] = None,
                    on_window: Optional[Callable[[int, int], None]] = None) -> Calibration:
    """Measure every layer's sensitivity on ``windows`` windows after the first ``offset``, then allocate."""
    import torch

    from kvcx.models import load_dataset_text, load_model_and_tokenizer, resolve_model
    from kvcx.validation import check_window, window_starts

    t0 = time.perf_counter()
    if config.layer_bits:
        raise KvcxError("calibrate starts from a config without per-layer widths; pass a --scheme, not a --plan")
    if windows < 1 or offset < 0:
        raise KvcxError(f"--windows must be >= 1 and --offset >= 0, got {windows} and {offset}")
    check_window(window, stride, windows, context_limit=1 << 62)
    base_bpv = (config.key.bits_per_value() + config.value.bits_per_value()) / 2
    if not (math.isfinite(budget) and budget >= base_bpv):   # checked before the model runs, not after
        raise KvcxError(f"--budget {budget} bits/value must be a number at or above the base config's {base_bpv:.3f}; "
                        "raise it or pick a scheme with fewer bits (kvcx2, kvcx3)")
    text = load_dataset_text(dataset_file)
    source = resolve_model(model) if loaded is None else None
    m, tok, name = loaded if loaded is not None else load_model_and_tokenizer(source, cpu=cpu)
    n_layers = int(m.config.num_hidden_layers)
    ids = torch.tensor(tok(text, return_tensors=None)["input_ids"], dtype=torch.long)
    starts = window_starts(ids.numel(), window, stride, 0)
    if len(starts) < offset + windows:
        raise KvcxError(f"the calibration text has {len(starts)} windows of {window}; --offset {offset} + --windows "
                        f"{windows} needs more: lower --offset or use a longer text")
    starts = starts[offset:offset + windows]
    if on_phase:
        on_phase(1, 2, f"{name}: {n_layers} layers x keys/values, {windows} windows from window {offset}, "
                       f"{config.describe()}")
    sens, tokens = layer_sensitivity(m, ids, starts, window, stride, config, n_layers, on_window)
    plan, steps = allocate(sens, config, n_layers, budget)
    if on_phase:
        on_phase(2, 2, f"plan: {plan.bits_per_value(n_layers):.3f} bits/value nominal, "
                       f"{len(plan.layer_bits)} layers raised")
    return Calibration(config=plan, sensitivity=sens, budget=budget, bits_per_value=plan.bits_per_value(n_layers),
                       n_layers=n_layers, windows=windows, tokens=tokens, wall_time_s=time.perf_counter() - t0,
                       model=name, steps=steps)
