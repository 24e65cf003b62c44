"""StaticKvcxCache's MLA layer (DeepSeek V2/V3, Kimi K2.5, GLM-4 MoE Lite, Mistral 4, ...): the compressed latent
and the shared RoPE key packed in rows as long as the capacity, and a decode step that replays from a CUDA graph.

transformers (from 5.17) hands an MLA layer's cache the latent ``c`` [B, 1, S, rank] as its keys and the RoPE key
``r`` [B, 1, S, rope] as its values, and expands the context into per-head keys and values after the cache
(:mod:`kvcx.cache.latent`). This layer packs ``c`` with the keys' codec and ``r`` with the values' (the same 4-bit
``kvcx.int`` codecs, rows and residual as :class:`~kvcx.cache.static_layers.StaticKvcxLayer`, each of its width).
KvcxCache gives ``r`` a width per channel at 8 bits instead (:func:`kvcx.cache.layer_config.latent_rope_codec`); the
static layer's graph-capturable encode runs 4-bit ``kvcx.int`` codes, so here ``r`` keeps the values' 4 bits.

A decode step is, for each of the two, the full layer's encode launch (the token into the residual's slot, a full
residual into its page of the row); then, under the ``"kvcx"`` attention, the layer posts a "latent" step and
returns the step's own latent (the model expands that token alone). The attention
(:func:`kvcx.cache.attention_fn.latent_attention`) reads :meth:`StaticKvcxLatentLayer.latent_states`: the sinks,
the whole row decoded by the Triton codecs (launches that read nothing back: the record's checks are made once, at
the first step) and the residual, in one buffer allocated once, with a mask built on the device from the plan's
counters (the row's packed tokens and the residual's filled slots); and attends with ``kv_b_proj`` absorbed. Like
transformers' StaticCache, whose attention reads ``max_cache_len`` keys under a mask, a step's work is that of the
capacity, not of the tokens held: the price of one graph for every length. The decoded context is scratch that
the cache's MLA layers share (:class:`LatentContext`, one layer steps at a time; ``memory_report()['scratch_bytes']``):
one layer's, at the capacity.
"""
from __future__ import annotations

from typing import Optional

import torch

from kvcx.cache.attention_fn import HANDOFF, LATENT
from kvcx.cache.static_layers import StaticKvcxLayer, capturing
from kvcx.codecs import gpu
from kvcx.codecs.base import Codec, Packed
from kvcx.errors import KvcxError


class LatentContext:
    """The decoded context the MLA layers of one cache share (one layer's step runs at a time): a buffer a shape,
    dtype and device, allocated once."""

    def __init__(self):
        self._bufs = {}

    def get(self, shape: tuple, dtype, device) -> torch.Tensor:
        key = (tuple(shape), dtype, str(device))
        if key not in self._bufs:
            self._bufs[key] = torch.zeros(shape, dtype=dtype, device=device)
        return self._bufs[key]

    @property
    def nbytes(self) -> int:
        return int(sum(t.numel() * t.element_size() for t in self._bufs.values()))


class StaticKvcxLatentLayer(StaticKvcxLayer):
    """One MLA layer of a :class:`~kvcx.cache.static_cache.StaticKvcxCache` (the module's docstring); ``context``:
    the decoded context buffers the cache's MLA layers share."""

    widths_may_differ = True   # the latent and the RoPE key
    unexpandable_fix = ("use KvcxCache(model.config, fused=False) for this model instead of StaticKvcxCache (its "
                        "steps return the decoded context for the model to expand; a static cache's MLA steps attend "
                        "in the cache)")

    def __init__(self, key_codec: Codec, value_codec: Codec, plan_holder, residual_length: int, max_cache_len: int,
                 spec, context: LatentContext):
        super().__init__(key_codec, value_codec, plan_holder, residual_length, max_cache_len, spec.index)
        self.spec, self._shared = spec, context

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        H, D, Dv = key_states.shape[1], key_states.shape[-1], value_states.shape[-1]
        if H != 1 or tuple(self.spec.latent_widths or ()) != (D, Dv):
            raise KvcxError(f"StaticKvcxCache {self.spec.describe()}: the model hands this MLA layer keys "
                            f"{list(key_states.shape)} and values {list(value_states.shape)}, not its latent and RoPE "
                            f"key (one head of widths {self.spec.latent_widths}), as transformers caches them from "
                            "5.17: upgrade transformers, or use KvcxCache")
        super().lazy_initialization(key_states, value_states)
        B, P, cap = self.batch_size, self.residual_length, self._capacity()
        # the context as the attention reads it: the sinks, the whole row decoded, the residual (allocated once)
        self._context = tuple(self._shared.get((B, 1, self.t0 + cap + P, d), self.dtype, self.device)
                              for d in (D, Dv))
        # each row decoded at every step by launches that read nothing back (its checks made once, now)
        self._decoders = tuple(self._codecs[kind].decoder(self._row_record(kind), ("key", "value")[kind])
                               for kind in (0, 1))
        self._at = torch.arange(cap + P, device=self.device)

    def _row_record(self, kind: int) -> Packed:
        """The rows of the keys (0: the latent) or values (1: the RoPE key) as one record of the capacity: views of
        the buffers (a row's pages are in order), so that a decoder made once reads what every step wrote."""
        codec = self._codecs[kind]
        B, H, cap = self.batch_size, self.num_heads, self._capacity()
        D = (self.head_dim, self.value_dim)[kind]
        lay = codec.layout((B, H, cap, D), "history")
        codes, scales, zeros = self._bufs(kind)
        return Packed(codes=codes.view(-1), scales=scales.view(lay.scale_shape),
                      zeros=None if zeros is None else zeros.view(lay.scale_shape), sinks=None, shape=(B, H, cap, D),
                      dtype=gpu.dtype_name_of(self.res_k), config=codec.get_config(), meta={"partial_group": 0})

    def _decode(self, key_states, value_states):
        """The two encode launches of the full layer, then a "latent" step posted: the step's own latent and RoPE key
        returned for the model to expand."""
        self._encode_step(key_states, value_states)
        HANDOFF.post(key_states, self, LATENT)
        return key_states, value_states

    def _prompt(self, key_states, value_states):
        HANDOFF.drop_latent(self.layer_idx)   # a step of the prompt: the model expands the context returned
        return super()._prompt(key_states, value_states)

    def latent_states(self, attention_mask: Optional[torch.Tensor]):
        """A decode step's (latent [B, 1, T, rank], RoPE key [B, 1, T, rope], mask [B, 1, 1, T] boolean) over T =
        sinks + capacity + residual tokens: the row decoded on the device, the mask keeping the sinks, the row's
        packed tokens and the residual's filled slots (the plan's counters). Transformers' mask is not read (rows of
        equal length: a mask given from Python is refused, as the full layer's decode step refuses it)."""
        if attention_mask is not None and not capturing(self.res_k):
            raise KvcxError("StaticKvcxCache decodes rows of equal length: this step has an attention mask (left "
                            "padding, or a mask the model builds for another reason); use KvcxCache for padded "
                            "batches")
        plan, t0, P = self._plan.plan, self.t0, self.residual_length
        cap = self._capacity()
        for kind, (sink, res) in enumerate(((self.sink_k, self.res_k), (self.sink_v, self.res_v))):
            out = self._context[kind]
            self._decoders[kind](out, t0)
            if t0:
                out[:, :, :t0].copy_(sink)
            out[:, :, t0 + cap:].copy_(res)
        held = torch.cat([self._at[:cap] < plan.packed[:, None], self._at[:P] < plan.live[:, None]], dim=1)
        mask = torch.cat([held.new_ones(held.shape[0], t0), held], dim=1) if t0 else held
        return self._context[0], self._context[1], mask[:, None, None, :]

    def after_latent(self, absorbed: bool) -> None:
        """Nothing after the attention: the residual is encoded into its page by the step's own launches."""

    def attend(self, *args, **kwargs):
        raise KvcxError(f"StaticKvcxCache layer {self.layer_idx}: an MLA layer's decode step attends over its latent "
                        "(a 'latent' step), not through the fused kernel")

    def scratch_bytes(self) -> int:
        """None of its own: the decoded context is the cache's :class:`LatentContext`, counted once there."""
        return 0
