"""``kvcx calibrate``: per-layer bit widths from the model's measured sensitivity.

Layers are not equally fragile: on SmolLM2-135M, 2-bit keys in layer 18 cost 2,000x the KL divergence of
2-bit keys in layer 0, and 6 of the 60 (layer, keys/values) pairs carry 70 % of the total. Calibration measures
it: for every layer, for keys and values apart, and for every codec a plan may give them (the config's
options: for the presets 2, 3, 4 bits and groups of 128 for keys, symmetric and asymmetric 3/4-bit values;
see :meth:`KVConfig.options`), only that layer's keys (or values) go through that codec, everything else
stays exact, and the mean KL divergence of the next-token distributions from the exact model's is that
layer's sensitivity with that codec. :func:`allocate` then picks one option per layer and kind that
minimises the summed KLD within the bit budget: an exact knapsack over the measured figures. An option not
measured is estimated from the measured one nearest in bits/value at 4x per bit/value, which measurement
shows can be far off (keys lose ~10x from 3 to 2 bits, values ~3.5x): the plan says how many it estimated.

The calibration text comes from windows *after* the ones ``kvcx validate`` and ``bench/bench_quality.py``
score (``offset``, default 128 windows of 512), so a plan is never judged on the tokens that chose it.
For ``--scheme kvcx2w`` / ``kvcx2v`` (keys with a bit width per channel) calibration first measures how much
the queries weigh each key channel (:mod:`kvcx.quality.query_weights`: the mean square of each query channel, per
KV head), which the encoder multiplies into each channel's error when it chooses the widths; then each layer's
keys alone at each mean width, and the budget goes to the layers' widths (:mod:`kvcx.quality.width_plans`).

Tokens as a second axis (``--scheme kvcx+snapkv:0.5``): with a press, calibration also measures, for every
layer, the KLD of that layer alone evicted by the press at each keep ratio of :data:`KEEPS` (and the one
written), and the allocator then picks per layer a keep ratio *and* the keys' and values' codecs under one budget
counted whole: ``keep x (key + value bits/value) / 2`` plus the kept positions (a uint16 per kept token and KV
head, ``8 x keep / head_dim`` bits per value). A layer's KLD with both is estimated as the sum of its eviction's
and its codecs' (each measured with the rest of the cache exact), as the per-layer figures are summed across layers.

Hybrid models (sliding-window, chunked or linear-attention layers): only the layers whose keys and values the
cache holds are measured and planned (linear attention's states have none); a plan lists them by index with their
layer type (``layers``), and its bits per value are over them.

This module computes; it prints nothing. torch is imported inside the functions that need it.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

from kvcx.cache.layer_types import cached_layers, refuse_press, refuse_press_on_hybrid, text_config
from kvcx.codecs.kvconfig import KVConfig, layer_of, tag_of
from kvcx.codecs.plan_record import check_plan_record
from kvcx.presses import INDEX_BITS, Press, PressedSetting
from kvcx.errors import CodecError, KvcxError
from kvcx.quality import ranks
from kvcx.quality.query_weights import combine_query_sums, window_query_sums
from kvcx.quality.width_plans import UNITS as _UNITS
from kvcx.quality.width_plans import allocate_widths, check_widths_budget, width_plan, width_tags, widths_options
from kvcx.quality.width_plans import knapsack as _knapsack

DEFAULT_WINDOWS = 4
DEFAULT_OFFSET = 128      # windows skipped: validate scores the first 32, bench_quality the first 64
MAX_BITS = 4              # widths a plan may give a layer (configs without variants)
KINDS = ("key", "value")
KEEPS = (0.5, 0.25, 0.125)  # keep ratios a plan with a press may give a layer, besides 1 (no eviction)

Sensitivity = Dict[Tuple[str, int, str], float]   # (kind, layer, option tag) -> mean KLD, nats/token
Layers = Union[int, Sequence[int]]                # layer indices; a count n means layers 0..n-1


def _indices(layers: Layers) -> List[int]:
    return list(range(layers)) if isinstance(layers, int) else [int(L) for L in layers]


@dataclass
class Calibration:
    config: KVConfig                                   # the plan: the base config with per-layer widths
    sensitivity: Sensitivity                           # measured, each with config.codec_at(kind, tag)
    budget: float
    bits_per_value: float                              # the plan's nominal bits/value
    n_layers: int
    windows: int
    tokens: int
    wall_time_s: float = 0.0
    model: str = ""
    estimated_kld: float = 0.0                         # the plan's KLD as the allocator estimates it (a sum)
    extrapolated: int = 0                              # (kind, layer, option) figures the plan took unmeasured
    complete: bool = True                              # False: figures of one kind only, no plan (--reuse them)
    press: Optional[Press] = None                      # a keep ratio per layer (tokens as a second axis)
    head_dim: int = 0                                  # the model's (the kept positions' share of the bytes)
    layer_types: Tuple[Tuple[int, str], ...] = ()      # (layer, type) planned; () = every layer of n_layers

    @property
    def layer_indices(self) -> List[int]:
        """The layers the plan covers (a hybrid's attention layers; else 0..n_layers-1)."""
        return [L for L, _ in self.layer_types] if self.layer_types else list(range(self.n_layers))

    def to_dict(self) -> dict:
        return {"config": self.config.get_config(), "budget": self.budget, "bits_per_value": self.bits_per_value,
                "n_layers": self.n_layers, "windows": self.windows, "tokens": self.tokens, "model": self.model,
                "wall_time_s": self.wall_time_s,
                "estimated_kld": self.estimated_kld if self.complete and math.isfinite(self.estimated_kld) else None,
                "extrapolated": self.extrapolated, "complete": self.complete,
                **({"press": self.press.get_config(), "head_dim": self.head_dim} if self.press is not None else {}),
                **({"layers": [{"layer": L, "type": t} for L, t in self.layer_types]} if self.layer_types else {}),
                "sensitivity": [{"kind": k, "layer": L, "option": t, "kld": v}
                                for (k, L, t), v in sorted(self.sensitivity.items())]}

    @property
    def setting(self):
        """What validate and KvcxCache take: the plan's config, with its press when it has one."""
        return PressedSetting(self.press, self.config) if self.press is not None else self.config

    def base_sensitivity(self) -> Dict[Tuple[str, int], float]:
        """(kind, layer) -> KLD with the base config's own codec (for ranking layers)."""
        tags = {k: _base_tag(self.config, k) for k in KINDS}
        return {(k, L): v for (k, L, t), v in self.sensitivity.items() if t == tags[k]}


def _base_tag(config: KVConfig, kind: str) -> str:
    return f"b{(config.key if kind == 'key' else config.value).bits}"


def plan_options(config: KVConfig, kind: str) -> List[str]:
    """The option tags a plan may give ``kind`` (:meth:`KVConfig.options`), the base codec's first."""
    opts = config.options(kind, MAX_BITS)
    if kind == "key" and config.key.takes_weights:   # widths keys: the mean widths of the config's variants
        return opts
    base = _base_tag(config, kind)
    return [base] + [t for t in opts if t != base]


def _sel(tag: str):
    """A tag as a layer_bits entry: plain widths stay integers (``'b3'`` -> 3), variants their tag."""
    return int(tag[1:]) if tag[1:].isdigit() else tag


def _one_layer_roundtrip(config: KVConfig, kind: str, layer: int, tag: str):
    """Round trip that compresses only ``layer``'s keys or values with option ``tag`` (the rest stays exact)."""
    from kvcx.codecs.kvconfig import is_key_tensor
    from kvcx.quality.bridge import roundtrip_tensors

    codec = config.codec_at(kind, _sel(tag))
    one = KVConfig(key=codec, value=config.value, scheme=config.scheme, key_weights=config.key_weights,
                   key_rope=config.key_rope) if codec.takes_weights else \
        KVConfig(key=codec, value=codec, scheme=config.scheme, key_rope=config.key_rope)   # the queries' weights

    def rt(tensors):
        pick = {n: a for n, a in tensors.items()
                if layer_of(n) == layer and is_key_tensor(n) == (kind == "key")}
        if not pick:
            raise KvcxError(f"calibration: the cache has no {kind} tensor for layer {layer}")
        decoded, nbytes, stats = roundtrip_tensors(pick, one)
        return {**tensors, **decoded}, nbytes, stats
    return rt


def keep_ladder(press: Press) -> List[float]:
    """The keep ratios below 1 a plan with ``press`` chooses from: :data:`KEEPS` and the one written."""
    return sorted({*KEEPS, float(press.keep)} - {1.0}, reverse=True)


def keep_tag(keep: float) -> str:
    return f"k{keep:g}"


def layer_sensitivity(model, ids, starts: List[int], window: int, stride: int, config: KVConfig, layers: Layers,
                      options: Optional[Iterable[str]] = None,
                      on_window: Optional[Callable[[int, int], None]] = None,
                      press: Optional[Press] = None,
                      rank: ranks.Rank = ranks.ALONE, kinds: Sequence[str] = KINDS) -> Optional[Tuple[Sensitivity, int]]:
    """({(kind, layer, tag): mean KLD}, tokens scored), one layer's keys or values compressed at a time, with
    each of ``options`` (default: every option a plan may use) that the kind has; with a ``press``, also each
    layer alone evicted at each keep ratio of :func:`keep_ladder` (kind ``"keep"``, tag ``k0.5``). ``layers``: the
    layer indices to measure (a count n: 0..n-1). One of several ranks (:mod:`kvcx.quality.ranks`) scores its share
    of ``starts``; rank 0 gets every window's figures, added in the windows' order, the other ranks None. ``kinds``:
    keys and values, or one of them (widths keys: their values are not planned)."""
    from kvcx.quality.eviction import PressRoundtrip
    from kvcx.quality.scoring import compare_prefix

    want = None if options is None else set(options)
    roundtrips = {(kind, L, t): _one_layer_roundtrip(config, kind, L, t)
                  for L in _indices(layers) for kind in kinds for t in plan_options(config, kind)
                  if want is None or t in want or f"{kind}.{t}" in want}
    if press is not None:
        for r in keep_ladder(press):
            one = PressedSetting(Press(press.name, r, dict(press.options)))
            roundtrips.update({("keep", L, keep_tag(r)): PressRoundtrip(one, layers={L}) for L in _indices(layers)})
    if not roundtrips:
        raise KvcxError(f"options={','.join(sorted(want))} leaves nothing to measure: the plan's options are keys "
                        f"{','.join(plan_options(config, 'key'))}, values {','.join(plan_options(config, 'value'))}")
    runs = compare_prefix(model, ids, rank.shard(starts), window, stride, roundtrips, on_window)
    runs = ranks.gather_runs(rank, runs, len(starts))
    if not rank.leads:
        return None
    tokens = next(iter(runs.values())).tokens
    return {k: r.mean_kld for k, r in runs.items()}, tokens


def _estimate(measured: Dict[str, Tuple[float, float]], tag: str, cost: float) -> Tuple[float, bool]:
    """(KLD of option ``tag`` costing ``cost`` bits/value, whether it was estimated): measured, else from the
    measured option nearest in bits/value at 4x per bit/value. ``measured``: tag -> (KLD, its bits/value)."""
    if tag in measured:
        return max(measured[tag][0], 0.0), False
    kld, c = min(measured.values(), key=lambda m: (abs(m[1] - cost), m[1]))
    return max(kld, 0.0) * 4.0 ** -(cost - c), True


def _costs(config: KVConfig) -> Dict[Tuple[str, str], float]:
    return {(k, t): config.codec_at(k, _sel(t)).bits_per_value() for k in KINDS for t in plan_options(config, k)}


def check_budget(config: KVConfig, budget: float, cost: Optional[Dict[Tuple[str, str], float]] = None) -> None:
    """Refuse a budget the config's cheapest options cannot meet (before any model runs)."""
    cost = cost or _costs(config)
    least = sum(min(c for (k, _), c in cost.items() if k == kind) for kind in KINDS) / 2
    if not (math.isfinite(budget) and budget >= least - 1e-9):
        raise KvcxError(f"budget={budget} bits/value must be a number at or above the {least:.3f} the config's "
                        "cheapest codecs take; raise it or pick a scheme with fewer bits (kvcx2, kvcx3)")


def _measured(sensitivity, config: KVConfig, cost) -> Dict[Tuple[str, int], Dict[str, Tuple[float, float]]]:
    """{(kind, layer): {tag: (KLD, its bits/value)}} of the codecs' figures (keys and values; (kind, layer) keys
    mean the base codec; eviction figures and options the config has not are left out)."""
    measured: Dict[Tuple[str, int], Dict[str, Tuple[float, float]]] = {}
    for key, v in sensitivity.items():
        k, L, t = key if len(key) == 3 else (*key, _base_tag(config, key[0]))
        if k in KINDS and (k, tag_of(t)) in cost:
            measured.setdefault((k, L), {})[tag_of(t)] = (float(v), cost[(k, tag_of(t))])
    return measured


def allocate(sensitivity, config: KVConfig, layers: Layers, budget: float) -> Tuple[KVConfig, float, int]:
    """(plan, estimated KLD, figures estimated): one option per (kind, layer) of ``layers`` (indices; a count n:
    0..n-1) minimising the summed KLD with the mean nominal bits/value within ``budget`` (keys and values of
    every layer the same size).

    ``sensitivity`` maps (kind, layer, tag) to the KLD measured with ``config.codec_at(kind, tag)``
    ((kind, layer) keys mean the base codec). An exact multiple-choice knapsack in 1/64-bit units."""
    cost = _costs(config)
    check_budget(config, budget, cost)
    measured = _measured(sensitivity, config, cost)
    layers = _indices(layers)
    items = [(k, L) for L in layers for k in KINDS]
    missing = [i for i in items if not measured.get(i)]
    if missing:
        raise KvcxError(f"no sensitivity measured for {missing[0][0]}s of layer {missing[0][1]} "
                        f"({len(missing)} of {len(items)} missing): calibrate again (reusing saved figures, one counts "
                        "only where it was measured with the codec the base scheme gives that option)")
    options = {}
    for k, L in items:
        options[(k, L)] = [(t, int(round(cost[(k, t)] * _UNITS)), *_estimate(measured[(k, L)], t, cost[(k, t)]))
                           for t in plan_options(config, k)]
    most = sum(max(cost[(k, t)] for t in plan_options(config, k)) for k, _ in items) / len(items)
    cap = int(math.floor(min(budget, most) * len(items) * _UNITS + 1e-6))   # more than the costliest plan buys nothing
    estimated, picks = _knapsack([[(c, kld) for _, c, kld, _ in options[it]] for it in items], cap,
                                 f"budget={budget} bits/value")
    chosen, guessed = {}, 0
    for it, j in zip(items, picks):
        t, _, _, g = options[it][j]
        chosen[it] = _sel(t)
        guessed += g
    base = (config.key, config.value)
    layer_bits = [(L, chosen[("key", L)], chosen[("value", L)]) for L in layers
                  if (config.codec_at("key", chosen[("key", L)]), config.codec_at("value", chosen[("value", L)])) != base]
    plan = KVConfig(key=config.key, value=config.value, scheme=config.scheme, layer_bits=layer_bits,
                    variants=config.variants, key_rope=config.key_rope)
    return plan, estimated, guessed


def least_pressed_budget(config: KVConfig, press: Press, head_dim: int = 0) -> float:
    """The fewest bits/value a plan with ``press`` can take: the smallest keep of its ladder, the cheapest codecs,
    and the kept positions (``head_dim`` 0: before the model is known, positions left out)."""
    cost = _costs(config)
    r = min(keep_ladder(press) or [1.0])
    codec = sum(min(c for (k, _), c in cost.items() if k == kind) for kind in KINDS) / 2
    return r * codec + (INDEX_BITS * r / (2 * head_dim) if head_dim else 0.0)


def allocate_pressed(sensitivity, config: KVConfig, press: Press, layers: Layers, head_dim: int,
                     budget: float) -> Tuple[KVConfig, Press, float, int, float]:
    """(plan, press with a keep ratio per layer, estimated KLD, figures estimated, bits/value counted whole): per
    layer of ``layers`` (indices; a count n: 0..n-1) a keep ratio and the keys' and values' codecs, the summed KLD
    least within ``budget``."""
    layers = _indices(layers)
    n_layers = len(layers)
    if layers != list(range(n_layers)):
        refuse_press_on_hybrid([(L, "attention") for L in layers])
    cost = _costs(config)
    least = least_pressed_budget(config, press, head_dim)
    if not (math.isfinite(budget) and budget >= least - 1e-9):
        raise KvcxError(f"budget={budget} bits/value must be at least {least:.3f}: keep {min(keep_ladder(press)):g} of "
                        f"the tokens at the cheapest codecs of {config.scheme} (positions counted); raise it")
    measured = _measured(sensitivity, config, cost)
    keeps = [1.0] + keep_ladder(press)
    choices, meta = [], []
    for L in layers:
        if not (measured.get(("key", L)) and measured.get(("value", L))):
            raise KvcxError(f"no sensitivity measured for layer {L}'s keys or values: calibrate again")
        opts, info = [], []
        for r in keeps:
            e = 0.0 if r == 1.0 else sensitivity.get(("keep", L, keep_tag(r)))
            if e is None:
                raise KvcxError(f"no eviction sensitivity for layer {L} at keep {r:g}: calibrate again")
            for tk in plan_options(config, "key"):
                kk, gk = _estimate(measured[("key", L)], tk, cost[("key", tk)])
                for tv in plan_options(config, "value"):
                    kv, gv = _estimate(measured[("value", L)], tv, cost[("value", tv)])
                    bpv = r * (cost[("key", tk)] + cost[("value", tv)]) / 2 + \
                        (INDEX_BITS * r / (2 * head_dim) if r < 1.0 else 0.0)
                    opts.append((int(math.ceil(bpv * _UNITS - 1e-6)), max(e, 0.0) + kk + kv))
                    info.append((r, tk, tv, gk + gv, bpv))
        choices.append(opts)
        meta.append(info)
    cap = int(math.floor(budget * n_layers * _UNITS + 1e-6))
    estimated, picks = _knapsack(choices, cap, f"budget={budget} bits/value")
    chosen = [meta[i][j] for i, j in enumerate(picks)]
    base = (config.key, config.value)
    layer_bits = [(L, _sel(tk), _sel(tv)) for L, (_, tk, tv, _, _) in zip(layers, chosen)
                  if (config.codec_at("key", _sel(tk)), config.codec_at("value", _sel(tv))) != base]
    plan = KVConfig(key=config.key, value=config.value, scheme=config.scheme, layer_bits=layer_bits,
                    variants=config.variants, key_rope=config.key_rope)
    layer_keep = tuple(r for r, *_ in chosen)
    pressed = Press(press.name, sum(layer_keep) / n_layers, dict(press.options), layer_keep)
    return (plan, pressed, estimated, sum(g for *_, g, _ in chosen),
            sum(b for *_, b in chosen) / n_layers)


def saved_layer_types(saved: dict) -> Tuple[Tuple[int, str], ...]:
    """A plan file's ``layers`` ((layer, type), ...: a hybrid model's attention layers), () for a dense model's."""
    return tuple((int(r["layer"]), str(r["type"])) for r in saved.get("layers", ()))


def _saved_sensitivity(saved: dict, source: str) -> Tuple[KVConfig, Dict[Tuple[str, int, str], Tuple[float, object]], int]:
    """(base config, {(kind, layer, tag): (KLD, codec measured with)}, n_layers) of a plan file's JSON."""
    try:
        cfg = KVConfig.from_config(saved["config"]).base()
        n_layers = int(saved["n_layers"])
        layers = [L for L, _ in saved_layer_types(saved)] or range(n_layers)
        rows = {}
        for r in saved["sensitivity"]:
            k, L = r["kind"], int(r["layer"])
            if k == "keep":      # an eviction's figure: read by reallocate with the plan's press
                continue
            t = str(r.get("option", _base_tag(cfg, k)))   # earlier plans recorded the base codec only
            rows[(k, L, t)] = (float(r["kld"]), cfg.codec_at(k, _sel(t)))
    except (KeyError, TypeError, ValueError) as exc:
        raise KvcxError(f"{source}: not a plan written by `kvcx calibrate` (missing or bad field: {exc}); "
                        "calibrate again") from None
    covered = {(k, L) for k, L, _ in rows}
    want = {(k, L) for L in layers for k in KINDS}
    if not covered <= want or (saved.get("complete", True) and covered != want):
        raise KvcxError(f"{source}: the plan's sensitivities do not cover keys and values of its {len(want) // 2} "
                        "layers; calibrate again")
    return cfg, rows, n_layers


def reallocate(saved, budget: float, source="<plan>", base: Optional[KVConfig] = None) -> Calibration:
    """A new plan from the sensitivities earlier calibrations measured (plan files' JSON): one measurement,
    any number of budgets. ``saved`` may be one plan or several measured on the same model and text (e.g. one
    per width); a figure counts where it was measured with the codec the base config gives that width. The
    base config is ``base`` or the first plan's config without its per-layer widths."""
    plans = [saved] if isinstance(saved, dict) else list(saved)
    sources = [source] * len(plans) if isinstance(source, str) else list(source)
    if not plans:
        raise KvcxError("reallocate needs at least one saved plan")
    for p, s in zip(plans, sources):
        try:
            check_plan_record(p, s)
        except CodecError as exc:
            raise KvcxError(str(exc)) from None
    first_cfg = plans[0].get("config") if isinstance(plans[0], dict) else None
    try:
        saved_cfg = KVConfig.from_config(first_cfg) if isinstance(first_cfg, dict) else None
    except CodecError as exc:
        raise KvcxError(f"{sources[0]}: {exc}") from None
    if saved_cfg is not None and saved_cfg.key.takes_weights:   # the queries' weights, and each layer's widths
        start = base if base is not None and base.key.takes_weights else saved_cfg
        plan = width_plan(start, budget, {L: [list(r) for r in w] for L, w in saved_cfg.key_weights})
        n_layers = int(plans[0].get("n_layers", 0))
        types = saved_layer_types(plans[0])
        layers = [L for L, _ in types] or list(range(n_layers or 1))
        sens, estimated = {}, math.nan
        rows = [r for r in plans[0].get("sensitivity", ()) if r.get("kind") == "key"]
        if rows:   # measured per layer (plans before them: one mean width, the weights alone)
            measuring = KVConfig(key=plan.key, value=plan.value, scheme=plan.scheme, key_weights=plan.key_weights,
                                 variants=saved_cfg.variants, key_rope=plan.key_rope)
            sens = {("key", int(r["layer"]), str(r["option"])): float(r["kld"]) for r in rows}
            try:
                plan, estimated = allocate_widths(sens, measuring, layers, budget)
            except KvcxError as exc:   # the file named: its figures do not cover every layer's widths
                raise KvcxError(f"{sources[0]}: {exc}") from None
        return Calibration(config=plan, sensitivity=sens, budget=budget, bits_per_value=plan.bits_per_value(layers),
                           n_layers=n_layers, windows=int(plans[0].get("windows", 0)),
                           tokens=int(plans[0].get("tokens", 0)), model=str(plans[0].get("model", "")),
                           estimated_kld=estimated, layer_types=types)
    try:
        parsed = [_saved_sensitivity(p, s) for p, s in zip(plans, sources)]
    except CodecError as exc:
        raise KvcxError(f"{sources[0]}: {exc}") from None
    cfg0, _, n_layers = parsed[0]
    base = (base or cfg0).base()
    first = plans[0]
    types = saved_layer_types(first)
    layers = [L for L, _ in types] or n_layers
    for p, s, (_, _, n) in zip(plans[1:], sources[1:], parsed[1:]):
        same = (n, saved_layer_types(p), p.get("model"), p.get("windows"), p.get("tokens")) == \
               (n_layers, types, first.get("model"), first.get("windows"), first.get("tokens"))
        if not same:
            raise KvcxError(f"{s}: measured on another model or text than {sources[0]} (layers, model, windows, "
                            "tokens differ); reuse plans calibrated with the same --model, --windows and --offset")
    sens: Sensitivity = {}
    for _, rows, _ in parsed:
        for (k, L, t), (kld, codec) in rows.items():
            if t in plan_options(base, k) and codec == base.codec_at(k, _sel(t)):
                sens.setdefault((k, L, t), kld)
    if first.get("press") is not None:    # tokens as a second axis: the evictions' figures too
        refuse_press_on_hybrid(types)
        press, head_dim = _saved_press(first, sources[0])
        for r in first["sensitivity"]:
            if r["kind"] == "keep":
                sens[("keep", int(r["layer"]), r["option"])] = float(r["kld"])
        plan, pressed, estimated, guessed, bpv = allocate_pressed(sens, base, press, layers, head_dim, budget)
        return Calibration(config=plan, sensitivity=sens, budget=budget, bits_per_value=bpv, n_layers=n_layers,
                           windows=int(first.get("windows", 0)), tokens=int(first.get("tokens", 0)),
                           model=str(first.get("model", "")), estimated_kld=estimated, extrapolated=guessed,
                           press=pressed, head_dim=head_dim)
    plan, estimated, guessed = allocate(sens, base, layers, budget)
    return Calibration(config=plan, sensitivity=sens, budget=budget, bits_per_value=plan.bits_per_value(layers),
                       n_layers=n_layers, windows=int(first.get("windows", 0)), tokens=int(first.get("tokens", 0)),
                       model=str(first.get("model", "")), estimated_kld=estimated, extrapolated=guessed,
                       layer_types=types)


def _saved_press(saved: dict, source: str) -> Tuple[Press, int]:
    """(the press to allocate with again, head_dim) of a plan calibrated with one: its keep ladder the measured
    keep ratios (the largest of them as the press's written keep)."""
    measured = [float(r["option"][1:]) for r in saved["sensitivity"] if r["kind"] == "keep"]
    if not measured or not saved.get("head_dim"):
        raise KvcxError(f"{source}: the plan has a press but no eviction figures or head_dim: calibrate again")
    p = Press.from_config(saved["press"], source)
    return Press(p.name, max(measured), dict(p.options)), int(saved["head_dim"])


def run_calibration(config: KVConfig, budget: float, model: Optional[str] = None, dataset_file=None,
                    windows: int = DEFAULT_WINDOWS, offset: int = DEFAULT_OFFSET, window: int = 1024,
                    stride: int = 512, cpu: bool = False, device=None, loaded=None,
                    options: Optional[Sequence[str]] = None,
                    on_phase: Optional[Callable[[int, int, str], None]] = None,
                    on_window: Optional[Callable[[int, int], None]] = None,
                    press: Optional[Press] = None) -> Optional[Calibration]:
    """Measure every layer's sensitivity on ``windows`` windows after the first ``offset`` with ``options``
    (tags; default: every option a plan may use), then allocate; with a ``press``, keep ratios per layer too.

    Started by ``torchrun`` or ``accelerate launch`` with several processes, each rank measures every N-th window and
    rank 0 allocates from all of them (the one-process run's figures and plan, to the last digit on the CPU) and
    returns the plan; the other ranks report nothing and return None. ``device``: where the model runs (``"auto"``:
    spread over this machine's GPUs, :func:`~kvcx.quality.models.load_model_and_tokenizer`)."""
    import torch

    from kvcx.quality.models import load_dataset_text, load_model_and_tokenizer, pick_device, resolve_model
    from kvcx.quality.scoring import check_window, window_starts

    t0 = time.perf_counter()
    if config.layer_bits:
        raise KvcxError("calibrate starts from a scheme's config, without per-layer widths; pass a scheme, not a plan")
    widths = config.key.takes_weights
    if widths:   # the budget and the widths checked before the model runs
        tags = width_tags(options)
        check_widths_budget(config, budget, tags)
        width_plan(config, budget, {})
    if windows < 1 or offset < 0:
        raise KvcxError(f"windows={windows} must be >= 1 and offset={offset} >= 0")
    check_window(window, stride, windows, context_limit=1 << 62)
    allowed = {} if widths else {k: plan_options(config, k) for k in KINDS}   # (widths: checked above)
    if not widths and options is not None and (not options or any(all(t not in a and t not in [f"{k}.{x}" for x in a]
                                                        for k, a in allowed.items()) for t in options)):
        raise KvcxError(f"options={','.join(options)}: a plan from {config.scheme} chooses keys from "
                        f"{','.join(allowed['key'])} and values from {','.join(allowed['value'])}; measure some of those")
    if press is not None:
        if widths or options is not None:
            raise KvcxError("a press (tokens as a second axis) is calibrated with the per-layer widths of a scheme such "
                            "as kvcx or kvcx3, every option measured: leave --options out and use such a scheme")
        least = least_pressed_budget(config, press)
        if not (math.isfinite(budget) and budget >= least - 1e-9):
            raise KvcxError(f"budget={budget} bits/value must be above {least:.3f}: keep {min(keep_ladder(press)):g} of "
                            f"the tokens at the cheapest codecs of {config.scheme}, plus their positions; raise it")
    elif not widths:
        check_budget(config, budget)   # before the model runs, not after
    planned = ranks.planned()   # fewer windows than ranks: refused before the model loads
    planned.check_enough(windows, "window", f"give --windows {planned.size} or more")
    text = load_dataset_text(dataset_file)
    source = resolve_model(model) if loaded is None else None
    device = ranks.local_device(device, cpu)   # under a launcher on GPUs: the one LOCAL_RANK names
    rank = ranks.join(next(loaded[0].parameters()).device.type if loaded is not None
                      else pick_device(device, cpu).type)
    ranks.same_request(rank, {"config": config, "budget": budget, "text": text, "model": str(source or loaded[2]),
                              "windows": windows, "offset": offset, "window": window, "stride": stride,
                              "options": options, "press": press})
    if not rank.leads:   # rank 0 reports
        on_phase = on_window = None
    m, tok, name = loaded if loaded is not None else load_model_and_tokenizer(source, device=device, cpu=cpu)
    from kvcx.quality.bridge import model_frame

    config = model_frame(config, m)   # keys coded before RoPE: the model's own frequencies, written in the plan
    n_layers = int(text_config(m.config).num_hidden_layers)   # a multimodal class: its decoder's
    if press is not None:
        refuse_press(m.config, whole_model=True)   # a hybrid or MLA model: before any window is scored
    types = cached_layers(m.config)
    layers = [L for L, _ in types]
    if layers == list(range(n_layers)) and all(t == "full_attention" for _, t in types):
        types = ()   # a dense model: every layer, as plans have always said
    ids = torch.tensor(tok(text, return_tensors=None)["input_ids"], dtype=torch.long)
    starts = window_starts(ids.numel(), window, stride, 0)
    if len(starts) < offset + windows:
        raise KvcxError(f"the calibration text has {len(starts)} windows of {window}; offset={offset} + windows="
                        f"{windows} needs more: lower the offset or use a longer text")
    starts = starts[offset:offset + windows]
    rank.check_enough(windows, "window", f"give --windows {rank.size} or more")
    if widths:
        if on_phase:
            on_phase(1, 3, f"{name}: the queries of {len(layers)} layers, {windows} windows from window {offset}")
        cached, shapes, parts = window_query_sums(m, ids, rank.shard(starts), window, on_window, layers)
        parts = ranks.gather_in_order(rank, parts, len(starts))
        # every rank measures its windows with the weights of them all (rank 0 added them in the windows' order)
        weights = ranks.broadcast(rank, combine_query_sums(cached, shapes, parts) if rank.leads else None)
        measuring = widths_options(width_plan(config, budget, weights), tags)
        if on_phase:
            on_phase(2, 3, f"{name}: each layer's keys alone at {len(tags)} mean widths ({', '.join(tags)}), weighed "
                           f"by the queries, {windows} windows")
        measured = layer_sensitivity(m, ids, starts, window, stride, measuring, layers, None, on_window, None, rank,
                                     kinds=("key",))
        if not rank.leads:   # its windows' figures went to rank 0
            return None
        sens, tokens = measured
        plan, estimated = allocate_widths(sens, measuring, layers, budget)
        if on_phase:
            on_phase(3, 3, f"plan: keys {sum(plan.for_layer(L).key.bits for L in layers) / len(layers):.3f} bits per "
                           f"code on average, {plan.bits_per_value(layers):.3f} bits/value nominal")
        return Calibration(config=plan, sensitivity=sens, budget=budget, bits_per_value=plan.bits_per_value(layers),
                           n_layers=n_layers, windows=windows, tokens=tokens, wall_time_s=time.perf_counter() - t0,
                           model=name, estimated_kld=estimated, layer_types=types)
    if on_phase:
        n_opts = sum(len([t for t in a if options is None or t in options or f"{k}.{t}" in options])
                     for k, a in allowed.items())
        hybrid = f" (the attention layers of {n_layers})" if types else ""
        on_phase(1, 2, f"{name}: {len(layers)} layers{hybrid} x {n_opts} key/value codecs, {windows} windows from window "
                       f"{offset}, {config.describe()}")
    measured = layer_sensitivity(m, ids, starts, window, stride, config, layers, options, on_window, press, rank)
    if not rank.leads:   # its windows' figures went to rank 0
        return None
    sens, tokens = measured
    if press is not None:
        text_cfg = text_config(m.config)
        heads = int(text_cfg.num_attention_heads)
        head_dim = int(getattr(text_cfg, "head_dim", None) or text_cfg.hidden_size // heads)
        plan, pressed, estimated, guessed, bpv = allocate_pressed(sens, config, press, layers, head_dim, budget)
        if on_phase:
            on_phase(2, 2, f"plan: {bpv:.3f} bits/value counted whole, keep {pressed.keep:.3f} of the tokens on "
                           f"average, {len(plan.layer_bits)} layers' codecs changed")
        return Calibration(config=plan, sensitivity=sens, budget=budget, bits_per_value=bpv, n_layers=n_layers,
                           windows=windows, tokens=tokens, wall_time_s=time.perf_counter() - t0, model=name,
                           estimated_kld=estimated, extrapolated=guessed, press=pressed, head_dim=head_dim)
    measured_kinds = {k for k, _, _ in sens}
    if measured_kinds != set(KINDS):
        # --options measured one kind only: keep the figures (no plan yet); --reuse combines them with others
        return Calibration(config=config, sensitivity=sens, budget=budget, bits_per_value=config.bits_per_value(layers),
                           n_layers=n_layers, windows=windows, tokens=tokens, wall_time_s=time.perf_counter() - t0,
                           model=name, estimated_kld=math.nan, extrapolated=0, complete=False, layer_types=types)
    plan, estimated, guessed = allocate(sens, config, layers, budget)
    if on_phase:
        on_phase(2, 2, f"plan: {plan.bits_per_value(layers):.3f} bits/value nominal, "
                       f"{len(plan.layer_bits)} layers changed")
    return Calibration(config=plan, sensitivity=sens, budget=budget, bits_per_value=plan.bits_per_value(layers),
                       n_layers=n_layers, windows=windows, tokens=tokens, wall_time_s=time.perf_counter() - t0,
                       model=name, estimated_kld=estimated, extrapolated=guessed, layer_types=types)
