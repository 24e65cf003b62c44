"""StaticKvcxCache: a packed KV cache whose decode steps can be captured in a CUDA graph and replayed.

    from kvcx.cache import StaticKvcxCache      # registers the "kvcx" attention implementation
    model.set_attn_implementation("kvcx")
    cache = StaticKvcxCache(model.config, max_cache_len=8192)
    out = model.generate(**inputs, past_key_values=cache, max_new_tokens=256)

transformers' ``StaticCache`` with the keys and values packed by kvcx's codecs (the Triton backend): every buffer
is allocated once, at the first step, for ``max_cache_len`` tokens, and a decode step changes only their contents.
Nothing in a decode step depends on the host: the tokens held live in a device counter, the kernels read the
lengths from the device (:func:`kvcx.codecs.paged.attend`'s ``seq_lens`` and ``residual_lens``) and their grids
are sized for the capacity. So a whole step (the model, the argmax, the position's increment) can be captured in
a CUDA graph and replayed, as engines run decode (bench/bench_gpu.py's section 3 does).

Layout, a layer: the exact sink tokens [B, Hkv, t0, D]; the packed tokens after them in one row a slab of the
capacity (a :class:`kvcx.codecs.paged.PagedKV` of one page a batch row: the contiguous store read through the
paged kernel); a residual of ``residual_length`` exact tokens [B, Hkv, P, D], the page being filled. A decode step
is four launches a layer: for keys and for values one encode launch that writes the token into the residual's
slot and, at the step that fills the residual, encodes it into its page's place in the packed rows (the other
steps' programs stop after the write: the launch is the same at every step, its work is not); then the attention
over the packed pages before it, the sinks and the residual's filled slots in one softmax, and its merge (which
writes the output in the model's dtype). The residual's tokens are exact; a page is packed once whole, with the
bytes the codec writes for it alone.

A prompt (a step of more than one token, or any step before the sinks are filled) runs from Python: its whole
pages are encoded at once, the rest goes to the residual, and its attention reads the decoded history and the
prompt's own states (SDPA, as :class:`~kvcx.cache.kvcx_cache.KvcxCache`'s materialising path).

Hybrid models (:mod:`kvcx.cache.layer_types` reads their config as transformers' StaticCache does): full-attention
layers are packed as above; sliding and chunked layers are packed into a ring of pages as long as their window
(:class:`~kvcx.cache.static_layers.StaticKvcxWindowLayer`: the same four launches a step, the window's first token
a mask computed on the device, so their steps replay from a graph too; a window smaller than a page, or chunks of
part pages, are held as transformers' ``StaticSlidingWindowLayer`` holds them, and ``memory_report()`` says why);
MLA layers (DeepSeek V2/V3, Kimi K2.5) pack the latent and the RoPE key and attend over them with ``kv_b_proj``
absorbed (:mod:`kvcx.cache.static_latent`: the same encode launches, then the rows decoded on the device);
linear-attention and recurrent layers keep transformers' own layer class; ``memory_report()["layers"]`` says which
layers are packed; a layer type kvcx cannot pack is an error naming it, or kept with ``unsupported="keep"``.

What it does not do (an error says so): rows of different lengths (left padding: use KvcxCache), codecs the
Triton kernels do not run (4-bit ``kvcx.int`` only), models whose attention is not ``"kvcx"``, ``crop()``.
A step past ``max_cache_len`` from Python raises before it runs; inside a replayed graph it cannot raise: it is
flagged on the device (its writes kept within the buffers) and the next read from Python (``tokens``, a prompt,
``check()``, ``memory_report()``) raises; so do non-finite keys or values a replayed step packed (``check()``).
``get_seq_length()`` is the device counter (a tensor, as transformers' StaticCache gives): the model adds it to its
positions on the device, so a captured step reads it at every replay.
"""
from __future__ import annotations

from typing import List, Optional

import torch
import transformers
from transformers.cache_utils import Cache

from kvcx.cache.attention_fn import ATTN_IMPLEMENTATION
from kvcx.cache.kept import layer_bytes, layer_kwargs, transformers_layer_class
from kvcx.cache.layer_types import CHUNKED, FULL, STATE, WINDOWED, check_unsupported, layer_specs, text_config
from kvcx.cache.static_latent import LatentContext, StaticKvcxLatentLayer
from kvcx.cache.static_layers import PlanHolder, StaticKvcxLayer, StaticKvcxWindowLayer
from kvcx.codecs import gpu_attn
from kvcx.codecs.dtypes import is_int
from kvcx.codecs.kvconfig import DEFAULT_SCHEME, KVConfig
from kvcx.deps import check_transformers
from kvcx.errors import KvcxError

check_transformers(transformers.__version__)

class StaticKvcxCache(Cache):
    """A packed KV cache whose decode steps can be replayed from a CUDA graph (the module's docstring).

    Parameters
    ----------
    config: the model's config (its decoder text config: layers, heads).
    max_cache_len: tokens a row may hold (prompt and generated), allocated at the first step.
    group_size, scheme, bits, sinks, rotate, kv_config: the codecs, as for :class:`~kvcx.cache.KvcxCache` (4-bit
        ``kvcx.int`` codecs: what the Triton kernels run; the default the kvcx scheme).
    residual_length: exact tokens before a page is packed (a multiple of the keys' per-channel group, so a page
        holds whole groups; 64 by default).
    unsupported: "error" (default) or "keep", as :class:`~kvcx.cache.KvcxCache` takes it.
    launch: how the Triton kernels launch each step (:class:`kvcx.codecs.gpu_attn.LaunchSettings`); None (default):
        the defaults.
    """

    def __init__(self, config, max_cache_len: int, group_size: Optional[int] = None, scheme: str = DEFAULT_SCHEME,
                 residual_length: int = 64, bits: Optional[int] = None, sinks: Optional[int] = None,
                 rotate: Optional[bool] = None, kv_config: Optional[KVConfig] = None, unsupported: str = "error",
                 launch=None):
        if isinstance(max_cache_len, bool) or not is_int(max_cache_len) or max_cache_len < 1:
            raise KvcxError(f"max_cache_len must be a positive integer, got {max_cache_len!r}")
        if isinstance(residual_length, bool) or not is_int(residual_length) or residual_length < 16 or \
                residual_length & (residual_length - 1):
            raise KvcxError(f"residual_length must be a power of two from 16 (a page of the packed rows), got "
                            f"{residual_length!r}")
        kv = kv_config or KVConfig.from_scheme(scheme, group_size=group_size, bits=bits, sinks=sinks, rotate=rotate)
        text = text_config(config)
        specs = layer_specs(config)
        check_unsupported(specs, unsupported, "StaticKvcxCache")
        self._why_kept = {s.index: _why_kept(s, residual_length) for s in specs if s.kind in WINDOWED}
        packed = [s.index for s in specs if s.kind == FULL or s.kind in WINDOWED and not self._why_kept[s.index]]
        if not packed:
            raise KvcxError("StaticKvcxCache packs full-attention, sliding and chunked layers and this model has none "
                            "it can pack; use KvcxCache")
        kv = kv.with_latent_layers(())   # an MLA layer's RoPE key keeps the values' 4-bit codes here (static_latent)
        codecs = {i: (kv.for_layer(i).key, kv.for_layer(i).value) for i in packed}
        for i, (kc, vc) in codecs.items():
            for codec, what in ((kc, "keys"), (vc, "values")):
                if getattr(codec, "codec_id", None) != "kvcx.int" or codec.bits != 4:
                    bits = getattr(codec, "bits", None)
                    raise KvcxError(f"StaticKvcxCache layer {i}: the {what} codec {codec.codec_id!r}"
                                    f"{f' at {bits} bits' if bits is not None else ''} is not one the Triton kernels "
                                    "run; use a 4-bit kvcx.int scheme (the default 'kvcx', 'kivi', 'reference') or "
                                    "KvcxCache")
                if residual_length % codec.token_block:
                    raise KvcxError(f"residual_length ({residual_length}) must be a multiple of the {what}' group "
                                    f"({codec.token_block} tokens) so that a page holds whole groups")
            if kc.sinks != vc.sinks:
                raise KvcxError(f"StaticKvcxCache layer {i}: keys keep {kc.sinks} exact sink tokens and values "
                                f"{vc.sinks}; give both the same")
        # the sinks are the full layers' (a windowed layer keeps none)
        t0 = {codecs[s.index][0].sinks for s in specs if s.kind == FULL} or {0}
        if len(t0) > 1 or max_cache_len <= max(t0):
            raise KvcxError(f"StaticKvcxCache: every layer must keep the same sink tokens, fewer than max_cache_len "
                            f"({max_cache_len}); got {sorted(t0)}")
        self.kv_config = kv
        self.residual_length = residual_length
        self._config = text
        self.launch = gpu_attn.launch_settings(launch)   # how the Triton kernels launch
        self._holder = PlanHolder(residual_length, self.launch)
        self._t0 = t0.pop()
        self._max_len = max_cache_len
        self._device_step = False   # the current step's kind (decided at its first packed layer)
        self._first = packed[0]
        self._latent_context = LatentContext()   # the decoded context the MLA layers share
        self.specs = specs
        super().__init__(layers=[self._layer(s, codecs, max_cache_len) for s in specs])

    def _layer(self, spec, codecs: dict, max_cache_len: int):
        """A layer of the cache: packed (full, or windowed in a ring) or kept in transformers' own class."""
        if spec.index not in codecs:
            return self._kept(spec, max_cache_len)
        if spec.latent:
            return StaticKvcxLatentLayer(*codecs[spec.index], self._holder, self.residual_length, max_cache_len,
                                         spec, self._latent_context)
        if spec.kind == FULL:
            return StaticKvcxLayer(*codecs[spec.index], self._holder, self.residual_length, max_cache_len, spec.index)
        return StaticKvcxWindowLayer(*codecs[spec.index], self._holder, self.residual_length, max_cache_len, spec)

    def _kept(self, spec, max_cache_len: int):
        """A layer kvcx does not pack here, in transformers' own static class (as StaticCache builds it)."""
        cls = transformers_layer_class(spec, "STATIC")
        if cls is None:
            raise KvcxError(f"StaticKvcxCache {spec.describe()}: this transformers has no static cache layer for "
                            f"{spec.type!r}; use KvcxCache")
        kwargs = layer_kwargs(self._config, spec)
        return cls(**kwargs) if spec.kind == STATE else cls(max_cache_len=max_cache_len, **kwargs)

    @property
    def packed_layers(self) -> List["StaticKvcxLayer"]:
        """The layers kvcx packs (full, sliding and chunked ones)."""
        return [layer for layer in self.layers if isinstance(layer, StaticKvcxLayer)]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """A layer's new keys and values (transformers calls this once a layer and step). At the first layer the
        step is planned: one token a row after the sinks is a decode step (nothing read from the device), else a
        prompt step (the tokens held read once)."""
        if not is_int(layer_idx) or not 0 <= layer_idx < len(self.layers):
            raise KvcxError(f"layer_idx {layer_idx!r} is outside this StaticKvcxCache's {len(self.layers)} layers; "
                            "build the cache from the model's own config")
        S = key_states.shape[-2]
        layer = self.layers[layer_idx]
        if not isinstance(layer, StaticKvcxLayer):   # kept in transformers' own class
            if self.specs[layer_idx].kind == STATE:
                raise KvcxError(f"StaticKvcxCache {self.specs[layer_idx].describe()}: the model's config says this "
                                "layer has no per-token keys and values, but the model hands it some: build the "
                                "cache from the model's own config (model.config)")
            return layer.update(key_states, value_states, *args, **kwargs)
        if layer_idx == self._first and getattr(self._config, "_attn_implementation", None) != ATTN_IMPLEMENTATION:
            raise KvcxError(f"StaticKvcxCache needs the model's attention to be {ATTN_IMPLEMENTATION!r}: import "
                            f"kvcx.cache, then model.set_attn_implementation({ATTN_IMPLEMENTATION!r})")
        plan = self._holder.plan or self._holder.start(key_states.shape[0], self._t0, self._max_len,
                                                       key_states.device)
        if layer_idx == self._first:   # the step's kind, decided once for all its layers
            self._device_step = S == 1 and plan.host_len >= self._t0 and plan.host_len > 0
            if self._device_step:
                plan.advance()
            else:
                plan.begin_prompt(S)
        return layer.update(key_states, value_states, device_step=self._device_step)

    def get_seq_length(self, layer_idx: int = 0):
        """The tokens held, as a device tensor (:meth:`StaticKvcxLayer.get_seq_length`, the first packed layer's);
        ``tokens`` reads it."""
        return self.layers[self._first].get_seq_length()

    @property
    def tokens(self) -> int:
        """The tokens held, read from the device (a KvcxError if a replayed step ran past ``max_cache_len``)."""
        plan = self._holder.plan
        return 0 if plan is None else plan.sync("tokens")

    def check(self) -> int:
        """The tokens held, read from the device, and what a decode step replayed from a graph could not raise
        there: a KvcxError for a step past ``max_cache_len``, or for keys or values that held NaN or Inf (the
        encoder's flags; each layer's, one read)."""
        held = self.tokens
        layers = [layer for layer in self.packed_layers if layer.is_initialized]
        if layers:
            bad = torch.stack([layer.flag.any() for layer in layers]).tolist()
            if any(bad):
                first = layers[bad.index(True)].layer_idx
                raise KvcxError(f"StaticKvcxCache layer {first}: a decode step's keys or values held NaN or Inf (the "
                                "model's states: check its inputs and dtype); what that step packed is not usable")
        return held

    def reset(self):
        super().reset()
        if self._holder.plan is not None:
            self._holder.plan.reset()

    def memory_report(self) -> dict:
        """Bytes the cache holds (allocated for ``max_cache_len``): packed rows, exact sinks and residual, a page's
        encode buffers, what the layers it keeps in transformers' classes hold (kept_bytes; ``layers`` says which);
        the tokens held (:meth:`check`: read from the device) and the bytes a BF16 cache of the
        capacity holds."""
        layers: List[StaticKvcxLayer] = [layer for layer in self.packed_layers if layer.is_initialized]
        packed = sum(layer.packed_bytes() for layer in layers)
        exact = sum(layer.exact_bytes() for layer in layers)
        scratch = sum(layer.scratch_bytes() for layer in layers) + self._latent_context.nbytes
        # like with like: StaticCache holds a windowed layer's window only (StaticSlidingWindowLayer)
        static = sum(2 * layer.batch_size * layer.num_heads * layer.get_max_cache_shape()
                     * (layer.head_dim + layer.value_dim) for layer in layers)
        steps = {k: sum(layer.steps[k] for layer in self.packed_layers) for k in ("device", "prompt")}
        kept = sum(layer_bytes(layer) for layer in self.layers if not isinstance(layer, StaticKvcxLayer))
        return {"packed_bytes": packed, "residual_bytes": exact, "scratch_bytes": scratch, "kept_bytes": kept,
                "total_bytes": packed + exact + scratch + kept, "tokens": self.check(), "max_cache_len":
                self._max_len, "bf16_static_bytes": static, "attention_steps": steps, "backend": "triton",
                "layers": [{"index": s.index, "type": s.type,
                            "kvcx": "packed" if isinstance(layer, StaticKvcxLayer) else "kept",
                            "window": s.window, **({"why": self._why_kept[s.index]} if self._why_kept.get(s.index)
                                                   else {})} for s, layer in zip(self.specs, self.layers)]}


def _why_kept(spec, residual_length: int) -> str:
    """Why a windowed layer is kept in transformers' class ('' where it is packed in a ring): the residual's tokens
    must all lie in the window (a window of at least a page, chunks of whole pages)."""
    if spec.kind == CHUNKED and spec.window % residual_length:
        return (f"chunks of {spec.window} tokens are not whole pages of residual_length={residual_length}: "
                "choose a residual_length that divides the chunk to pack this layer")
    if spec.window < residual_length:
        return (f"a window of {spec.window} tokens is smaller than a page (residual_length={residual_length}): "
                "choose a residual_length of at most the window to pack this layer")
    return ""

