"""Plans over keys with a width per channel (``kvcx calibrate --scheme kvcx2v``, ``kvcx2w``, ``kvcx4w``): the queries'
weights (:mod:`kvcx.quality.query_weights`) and a mean width per layer's keys.

The widths codec already spends a tensor's bits where its channels need them; layers differ too. On the embedded
model (``bench/plans/measured/measured-kvcx2v-2.1.json``), with the queries' weights, layer 0's keys alone at 1 bit
per code cost 204x the KL divergence of layer 27's, and the 30 layers' keys at 2 bits span 0.00003 to 0.0013 nats. Calibration measures each layer's keys alone at each
width of :data:`WIDTH_OPTIONS` (the rest of the cache exact, as for the integer schemes' options) and
:func:`allocate_widths` picks one width per layer within the budget: the same exact knapsack in 1/64-bit units.
The values keep the scheme's codec in every layer (kvcx2v's E8P values have no other width).

This module computes; it prints nothing.
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence, Tuple

from kvcx.codecs.kvconfig import KVConfig, widths_bits, widths_tag
from kvcx.errors import KvcxError

UNITS = 64   # the knapsack's bit unit: 1/64 bit/value (FP16 scales of groups of 16-256 are multiples)
# the mean widths a plan may give a layer's keys (bits per code; the ranges' 16 / group bits come on top)
WIDTH_OPTIONS = (1.0, 1.5, 2.0, 2.5, 3.0, 4.0)


def width_plan(config: KVConfig, budget: float, weights: Dict[int, list]) -> KVConfig:
    """A per-channel-widths config whose keys spend ``budget`` bits/value (nominal, with the values' own) in every
    layer, the queries' ``weights`` attached: the base of a plan (its keys' codec where no layer is planned)."""
    key = config.key
    mean = 2 * budget - config.value.bits_per_value() - 16 / key.group_size
    mean = math.floor(mean * UNITS + 1e-6) / UNITS
    if not 0 < mean <= 8:
        raise KvcxError(f"budget={budget}: the keys would get {mean:g} bits per code on average, outside (0, 8]; "
                        f"with {config.value.bits_per_value():g}-bit values pick a budget between "
                        f"{(config.value.bits_per_value() + 16 / key.group_size) / 2 + 1 / 128:.3f} and "
                        f"{(config.value.bits_per_value() + 8 + 16 / key.group_size) / 2:.3f}")
    key = type(key).from_config({**key.get_config(), "bits": mean, "n_threads": key.n_threads})
    return KVConfig(key=key, value=config.value, scheme=config.scheme, key_weights=weights, key_rope=config.key_rope)


def width_tags(options: Optional[Sequence[str]] = None) -> List[str]:
    """The widths a plan chooses from, as variant tags ('b1w', 'b1hw', ... 'b4w'): ``options`` (tags, 'key.' or
    not) or :data:`WIDTH_OPTIONS`; a KvcxError naming the ones that are not widths tags."""
    every = [widths_tag(w) for w in WIDTH_OPTIONS]
    if options is None:
        return every
    tags = [t.split(".", 1)[1] if t.startswith("key.") else t for t in options]
    bad = [t for t in tags if widths_bits(t) is None or not 1 <= widths_bits(t) <= 4]
    if not tags or bad:
        raise KvcxError(f"options={','.join(options)}: keys with a width per channel choose among mean widths per "
                        f"layer, tagged {', '.join(every)} (bits per code; h: and a half); measure some of those")
    return sorted(set(tags), key=widths_bits)


def widths_options(config: KVConfig, tags: Sequence[str]) -> KVConfig:
    """``config`` (widths keys, the queries' weights) with a key variant for each tag: what calibration measures a
    layer's keys with, and what its plan selects from."""
    key = config.key
    variants = tuple((f"key.{t}", type(key).from_config({**key.get_config(), "bits": widths_bits(t),
                                                         "n_threads": key.n_threads})) for t in tags)
    return KVConfig(key=key, value=config.value, scheme=config.scheme, variants=variants,
                    key_weights=config.key_weights, keep_layers=config.keep_layers, key_rope=config.key_rope)


def _key_costs(config: KVConfig) -> Dict[str, float]:
    return {n.split(".", 1)[1]: c.bits_per_value() for n, c in config.variants if n.startswith("key.")}


def check_widths_budget(config: KVConfig, budget: float, tags: Sequence[str]) -> None:
    """Refuse, before any model runs, a budget that even the narrowest width of ``tags`` exceeds."""
    least = (min(widths_bits(t) for t in tags) + 16 / config.key.group_size + config.value.bits_per_value()) / 2
    if not (math.isfinite(budget) and budget >= least - 1e-9):
        raise KvcxError(f"budget={budget} bits/value is below the {least:.3f} that {config.scheme}'s values and the "
                        f"narrowest keys ({min(widths_bits(t) for t in tags):g} bits per code) take; raise it")


def allocate_widths(sensitivity, config: KVConfig, layers: Sequence[int], budget: float) -> Tuple[KVConfig, float]:
    """(plan, estimated KLD): one mean width per layer's keys (``config``'s key variants, :func:`widths_options`)
    minimising the summed measured KLD with the nominal bits/value within ``budget``, the values at the scheme's
    codec. ``sensitivity`` maps ("key", layer, tag) to the KLD of that layer's keys alone at that width."""
    cost = _key_costs(config)
    tags = sorted(cost, key=lambda t: cost[t])
    check_widths_budget(config, budget, tags)
    missing = [L for L in layers if any(("key", L, t) not in sensitivity for t in tags)]
    if missing:
        raise KvcxError(f"no sensitivity measured for the keys of layer {missing[0]} at every width "
                        f"({len(missing)} of {len(layers)} layers): calibrate again")
    value = config.value.bits_per_value()
    most = max(cost.values())
    cap = int(math.floor((2 * min(budget, (most + value) / 2) - value) * len(layers) * UNITS + 1e-6))
    estimated, picks = knapsack([[(int(round(cost[t] * UNITS)), max(float(sensitivity[("key", L, t)]), 0.0))
                                  for t in tags] for L in layers], cap, f"budget={budget} bits/value")
    plan = KVConfig(key=config.key, value=config.value, scheme=config.scheme, variants=config.variants,
                    layer_bits=tuple((int(L), tags[j], config.value.bits) for L, j in zip(layers, picks)),
                    key_weights=config.key_weights, keep_layers=config.keep_layers, key_rope=config.key_rope)
    return plan, estimated


def knapsack(choices: List[List[Tuple[int, float]]], cap: int, what: str) -> Tuple[float, List[int]]:
    """(least summed KLD, the choice per item) picking one (cost in units, KLD) per item within ``cap`` units."""
    import numpy as np

    best = np.full(cap + 1, np.inf)
    best[0] = 0.0
    picks = []
    for options in choices:
        nxt = np.full(cap + 1, np.inf)
        pick = np.zeros(cap + 1, dtype=np.int32)
        for j, (c, kld) in enumerate(options):
            if c > cap:
                continue
            cand = np.full(cap + 1, np.inf)
            cand[c:] = best[:cap + 1 - c] + kld
            better = cand < nxt
            nxt[better] = cand[better]
            pick[better] = j
        best = nxt
        picks.append(pick)
    if not np.isfinite(best).any():
        raise KvcxError(f"no plan fits {what}; raise the budget")
    at = int(np.argmin(best))          # the least KLD; of equal ones the fewest bits
    total, chosen = float(best[at]), []
    for options, pick in zip(reversed(choices), reversed(picks)):
        j = int(pick[at])
        chosen.append(j)
        at -= options[j][0]
    return total, chosen[::-1]
