"""Query weights for ``--scheme kvcx2w`` (keys with a bit width per channel): how much the queries weigh each
key channel, measured on the calibration text (:mod:`kvcx.quality.calibrate` turns them into a plan). torch is
imported inside the function that needs it."""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Tuple

from kvcx.cache.layer_types import cached_layers, layer_specs, text_config
from kvcx.deps import decoder_of
from kvcx.errors import KvcxError

def window_query_sums(model, ids, starts: List[int], window: int,
                      on_window: Optional[Callable[[int, int], None]] = None,
                      layers: Optional[Sequence[int]] = None) -> Tuple[list, list, list]:
    """(layers, [(heads, kv_heads, head_dim) per layer], [([sum of q^2 per KV head and channel, per layer], tokens)
    per window]): each layer's queries as its attention reads them (:func:`kvcx.cache.query_tap.tapping_queries`:
    after the family's q_norm, Qwen 3.5's gate split and the rotary embedding), a window at a time, their query heads
    summed onto the KV head they read (grouped-query attention), so that windows measured apart (the ranks of
    :mod:`kvcx.quality.ranks`) add up in the windows' order (:func:`combine_query_sums`) to the same weights.
    ``layers``: the layers to weigh (default: the layers the cache holds keys and values for, :func:`cached_layers`),
    each with its own heads and head_dim."""
    import torch

    from kvcx.cache.query_tap import tapping_queries

    specs = {s.index: s for s in layer_specs(model.config)}
    layers = [L for L, _ in cached_layers(model.config)] if layers is None else list(layers)
    cfg = text_config(model.config)
    latent = [L for L in layers if specs[L].latent]
    if latent:
        raise KvcxError(f"query weights: layer {latent[0]} is multi-head latent attention (MLA): its keys are the "
                        "compressed latent, which the queries read only through kv_b_proj, so they are not weighed "
                        "per channel here; use --scheme kvcx2w without a plan (the widths then weigh every channel "
                        "alike), or a kvcx3 / kvcx2 plan")
    shapes = []
    for L in layers:
        spec = specs[L]
        heads = int(spec.heads or cfg.num_attention_heads)
        kv_heads = int(spec.kv_heads or getattr(cfg, "num_key_value_heads", None) or heads)
        head_dim = int(spec.key_dim or getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
        if heads % kv_heads or head_dim % 2:
            raise KvcxError(f"query weights: layer {L}'s {heads} query heads do not group onto {kv_heads} KV heads "
                            "of even head_dim")
        shapes.append((heads, kv_heads, head_dim))
    slot = {L: i for i, L in enumerate(layers)}
    parts = []   # per window of this rank's: ([sum of q^2 per layer], tokens)

    def tap(module, query, key):
        i = slot.get(getattr(module, "layer_idx", None))
        if i is None:
            return
        heads, kv_heads, head_dim = shapes[i]
        if query.shape[1] != heads or key.shape[1] != kv_heads or query.shape[-1] != head_dim:
            raise KvcxError(f"query weights: layer {layers[i]}'s attention read queries of {query.shape[1]} heads x "
                            f"{query.shape[-1]} over {key.shape[1]} KV heads, its config says {heads} x {head_dim} "
                            f"over {kv_heads}; fix the model's config (layer_types, head_dim, num_key_value_heads)")
        b, _, n, _ = query.shape
        q = query.detach().double().reshape(b, kv_heads, heads // kv_heads, n, head_dim)
        parts[-1][0][i] = (q * q).sum(dim=(0, 2, 3)).cpu()
        if i == 0:
            parts[-1][1] += b * n

    dev = next(model.parameters()).device
    decoder = decoder_of(model)
    with torch.inference_mode(), tapping_queries(model, tap):
        for w, a in enumerate(starts):
            parts.append([[None] * len(layers), 0])
            decoder(input_ids=ids[a:a + window][None].to(dev), use_cache=False)   # no logits
            missed = [L for L, s in zip(layers, parts[-1][0]) if s is None]
            if missed:
                raise KvcxError(f"query weights: layer {missed[0]}'s attention never called transformers' attention "
                                "function, so its queries were not read; weigh only attention layers (layers=...) "
                                "or use --scheme kvcx2w without a plan")
            if on_window:
                on_window(w + 1, len(starts))
    return layers, shapes, parts


def combine_query_sums(layers: Sequence[int], shapes: Sequence[tuple], parts: Sequence[tuple]) -> Dict[int, list]:
    """{layer: [[mean q^2 per channel] per KV head]} from :func:`window_query_sums`' windows, added in their order,
    the two channels of each rotary pair (c, c + head_dim / 2) averaged, since RoPE turns one into the other as
    positions advance. A key channel's quantization error moves the attention logits by q_c * error_c, so these
    are the weights of the keys' squared errors."""
    import torch

    sums = [torch.zeros(kv, d, dtype=torch.float64) for _, kv, d in shapes]
    count = 0
    for window_sums, tokens in parts:
        for i, s in enumerate(window_sums):
            sums[i] += s
        count += tokens
    out = {}
    for L, m, (_, _, head_dim) in zip(layers, sums, shapes):
        m = m / max(1, count)
        m = (m + m.roll(head_dim // 2, dims=-1)) / 2
        out[L] = [[float(f"{x:.6g}") for x in row] for row in m.tolist()]
    return out
