"""Token eviction run on a model's cache (the presses of :mod:`kvcx.presses`): the queries SnapKV
scores with, captured during a prefill (:class:`QueryCapture`); a cache's tensors evicted layer by layer
(:func:`evict`); and :class:`PressRoundtrip`, a press composed with a codec as one round trip of the cache,
which ``validate``'s perplexity (prefix mode), its retrieval tasks and ``calibrate`` run alike.

After eviction the tokens that follow still run at their own positions (the context's length onwards): the kept
keys carry theirs in their rotary embedding. Bytes are counted whole: the kept tokens' codes (or FP16 values
for eviction alone) plus their positions, against the full context's values.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Dict, List, Optional

import numpy as np

from kvcx.codecs.metrics import ErrorStats
from kvcx.deps import decoder_of
from kvcx.presses import PressedSetting, index_bytes
from kvcx.errors import KvcxError


class QueryCapture:
    """The last ``window`` queries of every attention layer during a prefill, as the layer's attention reads them
    (after the family's q_norm and rotary embedding: :func:`kvcx.cache.query_tap.tapping_queries`), what SnapKV
    scores with; the tap is removed on exit."""

    def __init__(self, model, window: int):
        self.window, self.queries, self._model, self._stack = window, {}, model, contextlib.ExitStack()
        self._layers = len(decoder_of(model).layers)

    def __enter__(self):
        from kvcx.cache.query_tap import tapping_queries

        self._stack.enter_context(tapping_queries(self._model, self._tap))
        return self

    def _tap(self, module, query, key):
        import torch

        i = getattr(module, "layer_idx", None)
        if i is None:
            raise KvcxError(f"{type(module).__name__} has no layer_idx: SnapKV's queries are read per layer from "
                            "transformers' attention modules; use streaming or knorm with this model")
        q = query[0, :, -self.window:].detach().float()
        prev = self.queries.get(i)
        self.queries[i] = q if prev is None else torch.cat([prev, q], dim=1)[:, -self.window:]

    def __exit__(self, *exc):
        return self._stack.__exit__(*exc)

    def numpy(self) -> List[Optional[np.ndarray]]:
        """Per decoder layer, its queries ``[query heads, tokens, head_dim]``; None for a layer whose attention did
        not run (a linear-attention layer)."""
        return [self.queries[i].cpu().numpy() if i in self.queries else None for i in range(self._layers)]


def evict(tensors: Dict[str, np.ndarray], press, queries: Optional[List[np.ndarray]], layers=None):
    """(kept tensors, bytes of the kept positions) of a cache's tensors (``layer_{i}_key`` / ``_value``, each
    [1, kv_heads, tokens, head_dim]) through a press, layer by layer; ``layers``: only these (the others pass
    whole, their positions not counted)."""
    kept, nbytes, i = dict(tensors), 0, 0
    while f"layer_{i}_key" in tensors:
        if layers is not None and i not in layers:
            i += 1
            continue
        k, v = tensors[f"layer_{i}_key"], tensors[f"layer_{i}_value"]
        idx = press.select(k[0], queries[i] if queries is not None else None, layer=i)
        kept[f"layer_{i}_key"] = np.take_along_axis(k[0], idx[..., None], axis=1)[None]
        kept[f"layer_{i}_value"] = np.take_along_axis(v[0], idx[..., None], axis=1)[None]
        if idx.shape[1] < k.shape[2]:    # a layer that keeps every token needs no positions
            nbytes += index_bytes(*idx.shape)
        i += 1
    if layers is None and i == 0:
        raise KvcxError("press: the cache has no layer_0_key tensor; evict a model's cache (layer_{i}_key/_value)")
    return kept, nbytes


class PressRoundtrip:
    """A press composed with a codec as a round trip of a cache: ``rt(tensors, queries)`` -> (decoded tensors,
    bytes stored, ErrorStats of the kept tokens' codec error). ``query_window``: how many of the context's last
    queries the press reads (0: none), which the caller captures during the prefill. ``layers``: evict only these
    (calibration's one layer at a time). ``inner``: the codec's round trip (:func:`kvcx.quality.peers.roundtrip_of`
    builds the whole)."""

    def __init__(self, setting: PressedSetting, inner: Optional[Callable] = None, layers=None):
        self.press, self.layers = setting.press, layers
        self.inner = inner          # the codec's round trip (tensors -> decoded, bytes, stats); None: none
        self.query_window = self.press.window if self.press.needs_queries else 0

    def __call__(self, tensors, queries=None):
        if self.query_window and queries is None:
            raise KvcxError(f"press {self.press.spec} scores tokens with the model's queries; capture them during the "
                            "prefill (QueryCapture) and pass them")
        kept, nbytes = evict(tensors, self.press, queries, self.layers)
        if self.inner is None:
            return kept, nbytes + sum(a.size for a in kept.values()) * 2, ErrorStats(
                n=sum(a.size for a in kept.values()))
        decoded, packed, stats = self.inner(kept)
        return decoded, nbytes + packed, stats


@contextlib.contextmanager
def attending(model, cache):
    """The model's attention set to ``"kvcx"`` while it runs over an EvictedCache (which
    :func:`kvcx.quality.bridge.make_dynamic_cache` builds for layers of uneven counts) (each layer's own causal mask),
    restored after; nothing changes for any other cache."""
    from kvcx.cache.pressing import EvictedCache

    if not isinstance(cache, EvictedCache):
        yield model
        return
    from kvcx.cache.attention_fn import kvcx_attention

    with kvcx_attention(model):
        yield model
