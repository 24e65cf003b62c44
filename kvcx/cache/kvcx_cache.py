"""KvcxCache: a transformers cache that keeps the KV cache packed by kvcx's codecs, for every layer kind of the
models people run (full, sliding-window and chunked attention; linear-attention and recurrent layers alongside).

    from kvcx.cache import KvcxCache            # registers the "kvcx" attention implementation
    model.set_attn_implementation("kvcx")      # decode steps read the packed codes (the fused kernel)
    cache = KvcxCache(model.config, group_size=64, residual_length=64)
    out = model.generate(**inputs, past_key_values=cache, max_new_tokens=64)
    cache.memory_report()

One layer per cache layer of the model's config, as transformers' ``DynamicCache(config=...)`` builds them
(:mod:`kvcx.cache.layer_types` reads the config): a :class:`~kvcx.cache.layers.KvcxLayer` for full attention,
a :class:`~kvcx.cache.window_layer.KvcxWindowLayer` for sliding and chunked attention (the window's tokens packed, older
blocks dropped), transformers' own layer class for layers with no per-token keys and values (linear attention,
convolution, recurrent state) and, with ``unsupported="keep"``, for a layer type kvcx cannot pack.

Design (transformers' quantized-cache design, with appending instead of re-quantizing, :mod:`kvcx.cache.layers`):
each layer keeps a short full-precision residual; whole multiples of ``residual_length`` tokens are encoded by the
codecs into the layer's packed store. Attention over the store takes one of two paths per step, which the cache
decides once per step (at its first packed layer) and each layer applies with what it can do:

- fused (the model's attention set to ``"kvcx"``: single tokens, and on the CPU steps of a few hundred
  tokens over a packed history: a long prompt's later chunks, speculative decoding's drafts): the layer
  posts itself for the ``"kvcx"`` attention function (:mod:`kvcx.cache.attention_fn`: the contract every layer
  kind follows), which runs the fused kernel over the packed store, the sinks and the residual, with the
  window's first token, logit softcapping and per-head sinks (kvcx/codecs/cpu/attn*.h on the CPU, the Triton
  kernel of :mod:`kvcx.cache.device_store` on the device); no full-precision copy of the context exists;
- materialising (``fused=False``, other attention implementations, keys and values of different widths, steps
  of more tokens than the kernel's rows): the layer decodes its packed store into one scratch buffer shared by
  all layers and returns ``[decoded, residual, new]`` to attention.

Where the store lives: on the model's device with the Triton backend when the codecs run there (CUDA, or
``backend="triton"``): :class:`DevicePackedKV`, which the fused attention reads, for 4-bit integer codes;
:class:`~kvcx.cache.device_store.DeviceChunkKV`, decoded there each step, for E8P values and widths keys (kvcx2v,
kvcx4w, the guard's keys); else on the host (:class:`~kvcx.cache.store.PackedKV`, the CPU kernels).

A step of fewer than ``residual_length`` tokens stays in full precision until the next step, so that
``crop()`` can drop rejected draft tokens (speculative / assisted decoding); a longer step (a prompt
chunk, or generation-mode validation's chunks of ``residual_length``) is packed at once.

torch and transformers are imported when this module is imported; the rest of kvcx never imports it
unless asked.
"""
from __future__ import annotations

import math
import warnings
from typing import List, Optional

import torch
import transformers
from transformers.cache_utils import Cache

from kvcx.cache.attention_fn import ATTN_IMPLEMENTATION
from kvcx.cache.buffers import HeapRelease, KernelTimer, MaskConverter, Scratch, Shared, StepMode
from kvcx.cache.device_store import runs_on_device
from kvcx.cache.fused import Workspace
from kvcx.cache.induction import guarded_config
from kvcx.cache.kept import dynamic_cache_bytes, layer_bytes, layer_kwargs, transformers_layer_class
from kvcx.cache.layer_config import (fitted as _fitted, latent_rope_codec as _latent_rope_codec,
                                     on_backend as _on_backend, pressed as _pressed)
from kvcx.cache.layer_types import (FULL, STATE, UNSUPPORTED, WINDOWED, LayerSpec, check_unsupported, layer_specs,
                                    refuse_press, text_config)
from kvcx.cache.layers import KvcxLayer
from kvcx.cache.window_layer import KvcxWindowLayer
from kvcx.codecs import gpu_attn
from kvcx.codecs.backends import check_backend
from kvcx.codecs.dtypes import is_int
from kvcx.codecs.kvconfig import DEFAULT_SCHEME, KVConfig
from kvcx.deps import check_transformers
from kvcx.errors import KvcxError, SlowPathWarning

check_transformers(transformers.__version__)

__all__ = ["KvcxCache", "KvcxLayer", "KvcxWindowLayer", "dynamic_cache_bytes", "layer_bytes"]

DEFAULT_RESIDUAL = 64   # tokens a layer keeps in full precision before packing them, unless its codecs need more


class KvcxCache(Cache):
    """A packed KV cache for ``model.generate(..., past_key_values=KvcxCache(model.config))``.

    Parameters
    ----------
    config: the model's config (its decoder text config: the layers, their types, windows, heads and widths).
    group_size, scheme, bits, sinks, rotate: the codec, as for ``kvcx compress`` (default: the kvcx scheme).
    residual_length: tokens kept in full precision before they are packed (a multiple of the
        group size when keys are grouped per channel); None (default): 64, or the keys' groups of tokens where
        they are longer.
    kv_config: a ready :class:`kvcx.codecs.KVConfig` instead of the options above (a plan: ``kvcx.api.load_plan``).
    n_threads: OpenMP threads of the kernels (None = all).
    fused: None (default): decode steps and steps of up to a few hundred tokens over a packed history run
        the fused kernel when the model's attention is ``"kvcx"`` and the codecs allow it, else the
        materialising path; False: always materialise; True: such a step that cannot run fused is an error.
    release_heap: True (default): after a layer packs a prompt chunk of 1,024 tokens or more on the CPU, hand
        the C heap's free pages back to the OS (glibc's ``malloc_trim``; see :class:`kvcx.cache.buffers.HeapRelease`):
        without it a long prompt's prefill leaves the process holding GBs of freed temporaries. False: leave the
        heap to the C library.
    backend: where the packed store lives and which kernels run: None (default) by the model's device (CUDA:
        the Triton kernels, with the store on the GPU, for 4-bit integer codecs (fused), E8P values and widths
        keys (decoded there each step) where triton is installed; CPU: the CPU kernels); ``"triton"`` forces the
        device store and the Triton kernels (Triton's interpreter runs them on CPU tensors); ``"cpu"`` keeps the
        store on the host and the CPU kernels.
    unsupported: "error" (default): a layer type kvcx cannot pack (DeepSeek V4's compressed attention, ...) is a
        KvcxError naming it; "keep": such layers stay in transformers' own cache layer class, the others are
        packed (``memory_report()["layers"]`` says which).
    launch: how the Triton kernels launch a device store's decode steps (:class:`kvcx.codecs.gpu_attn.LaunchSettings`:
        the products' mode, warps, splits, ...); None (default): :data:`kvcx.codecs.gpu_attn.DEFAULT_LAUNCH`.
    guard_layers: layers whose keys get 8-bit codes on top of the scheme (the retrieval guard:
        :meth:`for_model` finds them with the induction probe); their values stay as the scheme gives them.

    A press (token eviction, ``scheme="kvcx+snapkv:0.5"``) runs on the full-attention layers; sliding and chunked
    layers hold their window anyway. A model with MLA layers refuses a press (its latent has no per-head keys to
    score and evict).
    """

    def __init__(self, config, group_size: Optional[int] = None, scheme: str = DEFAULT_SCHEME,
                 residual_length: Optional[int] = None, bits: Optional[int] = None, sinks: Optional[int] = None,
                 rotate: Optional[bool] = None, kv_config: Optional[KVConfig] = None, n_threads: Optional[int] = None,
                 fused: Optional[bool] = None, backend: Optional[str] = None, release_heap: bool = True,
                 unsupported: str = "error", launch=None, guard_layers=()):
        kv_config, press, scheme = _pressed(kv_config, scheme)   # a press composed by '+' (or a plan's)
        kv = kv_config or KVConfig.from_scheme(scheme, group_size=group_size, bits=bits, sinks=sinks, rotate=rotate,
                                               n_threads=n_threads)
        if kv_config is not None and n_threads is not None:  # n_threads applies to a ready config too
            kv = kv.with_threads(n_threads)
        if kv.key_rope is not None:
            raise KvcxError(f"kv_config {kv.scheme!r} codes keys before RoPE (key_rope), which KvcxCache's fused kernels "
                            "do not read yet (they take keys after RoPE): use the config without key_rope "
                            "(config.with_key_rope(None)); the gate and packed files take it")
        specs = layer_specs(config)
        latent = [s.index for s in specs if s.latent]
        if press is not None:
            try:
                refuse_press(config, whole_model=False)
            except KvcxError as exc:
                raise KvcxError(f"KvcxCache press {press.spec!r}: {exc}") from None
        if kv.latent_layers and list(kv.latent_layers) != latent:
            raise KvcxError(f"kv_config names MLA layers {list(kv.latent_layers)} (latent_layers: their values coded "
                            f"as a RoPE key); this model's MLA layers are {latent or 'none'}: use the config on the "
                            f"model it was made for, or config.with_latent_layers({latent})")
        if guard_layers:
            kv = guarded_config(kv, guard_layers, [s.index for s in specs if s.packed])
        every = (kv.key, kv.value, *(c for _, c in kv.variants))   # the codecs a layer may get
        if residual_length is None:   # 64 tokens, or the keys' groups along tokens where they are longer
            residual_length = math.lcm(DEFAULT_RESIDUAL, *(c.token_block for c in every))
        if isinstance(residual_length, bool) or not isinstance(residual_length, int) or residual_length < 1:
            raise KvcxError(f"residual_length must be a positive integer, got {residual_length!r}")
        if latent:   # MLA: the shared RoPE key's own codec (latent_rope_codec)
            every += (_latent_rope_codec(kv, residual_length),)
        for c in every:
            if residual_length % c.token_block:
                raise KvcxError(f"residual_length ({residual_length}) must be a multiple of the group size "
                                f"({c.token_block}) when grouping per channel, so every packed group is full")
        check_unsupported(specs, unsupported)
        kv = kv.engine_layers(len(specs), hybrid=any(s.kind == STATE for s in specs))   # the engine's exact layers
        if fused not in (None, True, False):
            raise KvcxError(f"fused must be None (automatic), True or False, got {fused!r}")
        if not isinstance(release_heap, bool):
            raise KvcxError(f"release_heap must be True or False, got {release_heap!r}")
        if backend is not None:
            kv = _on_backend(kv, check_backend(backend), len(specs))
        self.kv_config = kv
        self.guard_layers = tuple(sorted(int(L) for L in guard_layers))   # 8-bit keys (the retrieval guard)
        self.residual_length = residual_length
        self.fused = fused
        self.launch = gpu_attn.launch_settings(launch)   # how the Triton kernels launch (a device store's steps)
        self.specs = specs
        packed = [s for s in specs if s.packed and s.index not in kv.keep_layers]
        self.query_group = packed[0].query_group if packed else 0
        self._config = text_config(config)
        self._timer = KernelTimer()
        self._scratch = Scratch()
        self._masks = MaskConverter()
        self._heap = HeapRelease(enabled=release_heap)
        self._mode: Optional[StepMode] = None   # this step's, decided at its first packed layer
        self._hinted = False                    # told how to turn the fused path on (once per cache)
        self._first = packed[0].index if packed else -1
        workspace = Workspace()  # the fused kernel's scratch, one for all layers
        shared = Shared(self._scratch, workspace, self._masks, self._timer, self._heap, self.launch)
        super().__init__(layers=[self._layer(s, kv, shared, press) for s in specs])
        self._workspace = workspace
        self.press = press

    @classmethod
    def for_model(cls, model, guard: Optional[int] = None, **kwargs) -> "KvcxCache":
        """A KvcxCache for ``model`` (its config) whose retrieval layers keep finer keys, found without data.

        The induction probe (:mod:`kvcx.cache.induction`: random tokens fed twice, each head scored by how much it
        copies; 4 forwards of 1,024 tokens with the model's eager attention, 14 s for SmolLM2-135M on 2 CPU cores)
        ranks the attention layers, and the ``guard`` first get 8-bit keys (``guard_layers``). None (default): a
        tenth of the attention layers (:func:`~kvcx.cache.induction.guard_count`: 3 of 30, +0.19 bits/value on the
        default scheme) where the scheme's keys are integer codes (kvcx, kvcx3, ...), and no probe otherwise: keys
        of a width per channel (kvcx2w, kvcx4w, kvcx2v take the guard with ``guard=N``; on kvcx2v it costs +0.27
        bits and answered no needle more: :func:`~kvcx.cache.induction.guarded_by_default`), an engine's format, a
        plan, or ``backend="triton"``; 0: no probe, the plain scheme. The guarded keys are 8 bits in every channel
        (a widths codec, which the fused CPU kernel reads). Why: on 8,192-token passkeys at 90 % depth the default
        scheme loses prompts the exact cache answers (13 of 75 over three fresh seeds), the guard none of them
        (docs/results/retrieval-passkey-8k-90-for-model.md). On a CUDA model (or ``backend="triton"``) whose other
        layers run fused on the Triton kernels (4-bit integer codes) the guarded layers keep their records on the
        device too and decode them there each step (the widths codec's Triton kernels): a SlowPathWarning says so.
        ``kwargs``: the constructor's options."""
        from kvcx.cache.induction import (check_guardable, guard_count, guarded_by_default, induction_layers,
                                          induction_scores)

        if "guard_layers" in kwargs:
            raise KvcxError("KvcxCache.for_model finds the guard's layers itself: pass guard= (how many), or build "
                            "KvcxCache(model.config, guard_layers=[...]) with layers you chose")
        plain = cls(model.config, **kwargs)   # every option checked before the probe runs
        attending = [s.index for s in plain.specs if s.packed and s.index not in plain.kv_config.keep_layers]
        if guard is not None and (isinstance(guard, bool) or not isinstance(guard, int)
                                  or not 0 <= guard <= len(attending)):
            raise KvcxError(f"KvcxCache.for_model guard={guard!r}: how many attention layers get 8-bit keys, 0 to the "
                            f"model's {len(attending)} (None: a tenth of them)")
        if guard:
            check_guardable(plain.kv_config, f"KvcxCache.for_model guard={guard}", "or guard=0")
        if guard == 0 or not attending or (guard is None and (not guarded_by_default(plain.kv_config)
                                                              or kwargs.get("backend") == "triton")):
            return plain   # (backend="triton": every layer on the Triton kernels, which read 4-bit integer codes)
        n = guard_count(len(attending)) if guard is None else guard
        layers = induction_layers(induction_scores(model), n, among=attending, option="KvcxCache.for_model guard")
        cache = cls(model.config, guard_layers=layers, **kwargs)
        device = next(iter(model.parameters())).device
        on = plain.kv_config.with_backend(kwargs["backend"]) if kwargs.get("backend") else plain.kv_config
        if (device.type == "cuda" or kwargs.get("backend") == "triton") and runs_on_device(on.key, on.value, device):
            warnings.warn(f"KvcxCache.for_model: the guarded layers {sorted(layers)} decode their packed context on "
                          "the device each step and attend over it (the fused Triton attention reads 4-bit integer "
                          "codes, not the guard's 8-bit keys); the other layers run fused. guard=0 fuses every "
                          "layer", SlowPathWarning, stacklevel=2)
        return cache

    def _layer(self, spec: LayerSpec, kv: KVConfig, shared: Shared, press):
        """The cache layer of ``spec``: kvcx's for the kinds it packs, transformers' own for the others."""
        engine_kept = spec.index in kv.keep_layers    # a layer the engine leaves in the model's dtype
        if spec.kind in (STATE, UNSUPPORTED) or engine_kept:   # transformers' own class, as DynamicCache builds it
            cls = transformers_layer_class(spec, "DYNAMIC") or self._registered(spec.type)
            if cls is None:
                raise KvcxError(f"KvcxCache {spec.describe()}: neither kvcx nor this transformers knows the layer type "
                                f"{spec.type!r}: install a transformers that has this model (its modeling module "
                                "registers its cache layer), or fix the config's layer_types")
            return cls(**layer_kwargs(self._config, spec))
        codecs = _fitted(kv.for_layer(spec.index), spec.kv_heads, self.residual_length, spec.key_dim, spec.value_dim)
        cls = KvcxWindowLayer if spec.kind in WINDOWED else KvcxLayer
        return cls(codecs, self.residual_length, shared, spec, kv.weights_for(f"layer_{spec.index}_key"),
                   press=press if spec.kind == FULL else None,
                   rope_codec=_latent_rope_codec(codecs, self.residual_length) if spec.latent else None)

    def _registered(self, layer_type: str):
        """The cache layer class transformers maps ``layer_type`` to once the model's modeling module is imported
        (a model's own layer classes register themselves there), or None."""
        import importlib

        model_type = getattr(self._config, "model_type", None)
        if model_type:
            try:
                importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
            except ImportError:
                return None
        return transformers_layer_class(layer_type, "DYNAMIC")

    @property
    def packed_layers(self) -> List[KvcxLayer]:
        """The layers kvcx packs (full, sliding and chunked)."""
        return [layer for layer in self.layers if isinstance(layer, KvcxLayer)]

    @property
    def kernel_time_s(self) -> float:
        """Seconds spent in kvcx's kernels so far (encode, decode, fused attention)."""
        return self._timer.seconds

    def _step_mode(self, key_states: torch.Tensor) -> StepMode:
        """Whether this step's layer steps may run fused (read once per step: a config
        attribute is slow to read)."""
        if self.fused is False:
            return StepMode(reason="fused=False", kvcx_attention=self._kvcx_attention())
        if not self._kvcx_attention():
            return StepMode(required=bool(self.fused), kvcx_attention=False, reason=(
                f"KvcxCache(fused=True) needs the model's attention to be {ATTN_IMPLEMENTATION!r}: "
                f"load it with attn_implementation={ATTN_IMPLEMENTATION!r} or call "
                f"model.set_attn_implementation({ATTN_IMPLEMENTATION!r}) (after importing kvcx.cache)"))
        return StepMode(required=bool(self.fused))

    def _kvcx_attention(self) -> bool:
        return getattr(self._config, "_attn_implementation", None) == ATTN_IMPLEMENTATION

    def _hint_fused(self, key_states: torch.Tensor) -> None:
        """At the first decode step, once: a SlowPathWarning saying how to turn the fused path on when the step
        materialises only because the model's attention is not ``"kvcx"`` (``fused=None``, CPU, codecs the
        kernel reads)."""
        self._hinted = True
        impl = getattr(self._config, "_attn_implementation", None)
        first = self.packed_layers[0] if self.packed_layers else None
        if self.fused is not None or impl == ATTN_IMPLEMENTATION or first is None or first.fused_unsupported:
            return
        warnings.warn(
            f"KvcxCache: the model's attention is {impl!r}, so every decode step decodes the whole packed context "
            f"into full precision (the materialising path, slower and larger as the context grows). For the fused "
            f"path, which reads the packed codes: import kvcx.cache, then model.set_attn_implementation("
            f"{ATTN_IMPLEMENTATION!r}) (or load the model with attn_implementation={ATTN_IMPLEMENTATION!r}); "
            f"KvcxCache(fused=False) keeps this path without this warning.", SlowPathWarning, stacklevel=3)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Store a layer's new keys and values (transformers calls this once per layer and step)."""
        if not is_int(layer_idx) or not 0 <= layer_idx < len(self.layers):
            raise KvcxError(f"layer_idx {layer_idx!r} is outside this KvcxCache's {len(self.layers)} layers; build "
                            "the cache from the model's own config")
        layer = self.layers[layer_idx]
        if not isinstance(layer, KvcxLayer):   # a layer kept in transformers' own class
            if self.specs[layer_idx].kind == STATE:
                raise KvcxError(f"KvcxCache {self.specs[layer_idx].describe()}: the model's config says this layer has "
                                "no per-token keys and values, but the model hands it some: build the cache from "
                                "the model's own config (model.config)")
            return layer.update(key_states, value_states, *args, **kwargs)
        if layer_idx == self._first or self._mode is None:
            self._mode = self._step_mode(key_states)
            if not self._hinted and key_states.shape[-2] == 1:
                self._hint_fused(key_states)
        return layer.update(key_states, value_states, mode=self._mode)

    def memory_report(self) -> dict:
        """Bytes the cache holds, counted whole: packed stores + full-precision residual + the
        materialising path's full-precision scratch (released by fused steps) and the last step's
        attention mask (scratch_bytes) + the fused kernel's workspace (a few KiB per task, shared by
        the layers) + what the layers kvcx does not pack hold in transformers' own classes (kept_bytes: linear
        attention's states, a kept layer's keys and values).

        ``attention_steps``: layer steps per path (fused kernel, materialised scratch, or all full precision).
        ``fp16_equivalent_bytes``: what transformers' DynamicCache(config=...) holds for the same context in FP16
        (its sliding and chunked layers the last window - 1 tokens, its other layers the same bytes as here);
        ``bits_per_value`` over those values. ``layers``: each layer's index, type, what kvcx does with it
        (packed / kept), its window, its tokens held and its bytes, and why its steps materialise (None: fused).
        ``guard_layers``: the layers whose keys the retrieval guard gives 8-bit codes (:meth:`for_model`).
        ``heap_releases``: times a layer handed the C heap's free pages back after packing a prompt chunk
        (``release_heap``)."""
        mine = self.packed_layers
        packed = sum(layer.packed_bytes() for layer in mine)
        residual = sum(layer.residual_bytes() for layer in mine)
        kept = sum(layer_bytes(layer) for layer in self.layers if not isinstance(layer, KvcxLayer))
        scratch = self._scratch.nbytes() + self._masks.nbytes()
        workspace = self._workspace.nbytes
        values = sum(layer.equivalent_values() for layer in mine)
        steps = {k: sum(layer.steps[k] for layer in mine) for k in ("fused", "materialised", "full_precision")}
        first = next((layer for layer in mine if layer.is_initialized), None)
        return {"packed_bytes": packed, "residual_bytes": residual, "kept_bytes": kept, "scratch_bytes": scratch,
                "workspace_bytes": workspace, "total_bytes": packed + residual + kept + scratch + workspace,
                "tokens": self.get_seq_length(),
                "attention_steps": steps,
                "fp16_equivalent_bytes": 2 * values + kept,
                "model_dtype_equivalent_bytes": values * (first.dtype.itemsize if first is not None else 2) + kept,
                "bits_per_value": 8.0 * (packed + residual) / values if values else 0.0,
                "layers": [self._layer_report(spec, layer) for spec, layer in zip(self.specs, self.layers)],
                "backend": self.backend, "heap_releases": self._heap.count, "guard_layers": list(self.guard_layers)}

    @staticmethod
    def _layer_report(spec: LayerSpec, layer) -> dict:
        entry = {"index": spec.index, "type": spec.type, "kvcx": "packed" if spec.packed else "kept",
                 "window": spec.window}
        if isinstance(layer, KvcxLayer):
            entry["codecs"] = layer.codecs_described()
            held = (layer.quantized_length + layer.keys.shape[-2]) if layer.is_initialized else 0
            entry.update(tokens_held=held, bytes=layer.packed_bytes() + layer.residual_bytes(),
                         fused_unsupported=layer.fused_unsupported, steps=dict(layer.steps))
        else:
            entry.update(kvcx="kept", bytes=layer_bytes(layer),
                         kept_because="no per-token keys and values (transformers' own layer keeps its state)"
                         if spec.kind == STATE else "a layer type kvcx cannot pack (unsupported='keep')"
                         if spec.kind == UNSUPPORTED else "the engine keeps it in the model's dtype (vLLM's "
                         "TurboQuant: a dense model's first and last two layers)")
        return entry

    def nbytes(self) -> int:
        return self.memory_report()["total_bytes"]

    @property
    def backend(self) -> str:
        """Where the layers' packed stores are and which kernels run: "triton" (on the device), "cpu", both
        ("cpu+triton": a plan whose layers differ), or "" before the first step."""
        return "+".join(sorted({"triton" if layer.on_device else "cpu" for layer in self.packed_layers
                                if layer.is_initialized}))
