"""Token eviction in :class:`~kvcx.cache.KvcxCache`: a press (:mod:`kvcx.presses`) runs once per layer, on
the prompt's prefill, and the layer packs only the tokens it keeps.

The prefill's own attention reads every prompt token at full precision (the press runs after it, as kvpress
prunes after each layer's forward); SnapKV scores the prompt's tokens with the prompt's last queries, which the
``"kvcx"`` attention function hands to the layer. After the prefill a layer holds fewer tokens than the context
it stands for: it keeps counting the context's length (``get_seq_length``, so generate() places the tokens that
follow at their own rotary positions) and tells transformers' masks where its held tokens sit
(``get_mask_sizes``: the evicted tokens are an offset); steps of several tokens get a causal mask from the layer
itself (:func:`kvcx.cache.scores.tail_mask`), since layers with their own keep ratios hold different counts.

One sequence per cache (batch 1): a press keeps different tokens in each sequence. :class:`EvictedCache` is the
same idea for a transformers cache built from evicted tensors (``validate``'s prefix mode with a keep ratio per
layer). torch and transformers are imported with this module.
"""
from __future__ import annotations

from typing import Optional

import torch
from transformers import DynamicCache

from kvcx.cache.attention_fn import HANDOFF, TAIL
from kvcx.presses import Press
from kvcx.errors import KvcxError


class PrefillPress:
    """One layer's press: whether it has run, how many tokens it evicted, and the kept states of the prefill."""

    def __init__(self, press: Press, layer_idx: int):
        self.press, self.layer_idx = press, layer_idx
        self.done = False
        self.evicted = 0

    def due(self, held: int, tokens: int) -> bool:
        """Whether this step is the prefill the press runs on: the layer's first step, of several tokens."""
        return not self.done and held == 0 and tokens > 1

    def check(self, key_states: torch.Tensor, kvcx_attention: bool) -> None:
        if key_states.shape[0] != 1:
            raise KvcxError(f"KvcxCache with press {self.press.spec}: a press keeps different tokens in each sequence; "
                            f"this batch has {key_states.shape[0]}: use one KvcxCache per sequence (batch 1)")
        if not kvcx_attention:
            raise KvcxError(f"KvcxCache with press {self.press.spec} needs the model's attention to be 'kvcx' (the "
                            "prompt's queries and the kept tokens' masks are read there): import kvcx.cache, then "
                            "model.set_attn_implementation('kvcx')")

    def kept(self, keys: torch.Tensor, values: torch.Tensor, query: Optional[torch.Tensor] = None):
        """(keys, values) [1, kv_heads, kept, head_dim] the press keeps of the prefill's states; ``query``
        [1, query_heads, tokens, head_dim]: the prefill's queries (after their rotary embedding)."""
        queries = None
        if self.press.needs_queries:
            if query is None:
                raise KvcxError(f"press {self.press.spec} scores tokens with the prompt's queries; none reached "
                                f"layer {self.layer_idx}")
            w = min(self.press.window, query.shape[-2])
            queries = query[0, :, -w:].float().cpu().numpy()
        idx = self.press.select(keys[0].float().cpu().numpy(), queries, layer=self.layer_idx)
        at = torch.from_numpy(idx).to(keys.device)[None, :, :, None].expand(-1, -1, -1, keys.shape[-1])
        self.done, self.evicted = True, keys.shape[-2] - idx.shape[1]
        return keys.gather(2, at), values.gather(2, at)


class EvictedCache(DynamicCache):
    """A DynamicCache of a context whose layers a press left holding different counts of tokens (a plan's keep
    ratio per layer): transformers builds one mask for every layer, so each step's attention instead gets its
    layer's own causal mask through the ``"kvcx"`` attention (run the model with it, e.g. under
    :func:`kvcx.quality.eviction.attending`). The step's positions are the caller's (``position_ids``)."""

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        HANDOFF.post(keys, self, TAIL)
        return keys, values
