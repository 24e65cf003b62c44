"""KvcxCache: a transformers cache that keeps the KV cache packed by kvcx's codecs.

    from kvcx.cache import KvcxCache            # registers the "kvcx" attention implementation
    model.set_attn_implementation("kvcx")      # decode steps read the packed codes (the fused kernel)
    cache = KvcxCache(model.config, group_size=64, residual_length=64)
    out = model.generate(**inputs, past_key_values=cache, max_new_tokens=64)
    cache.memory_report()

Design (transformers' quantized-cache design, with appending instead of re-quantizing):
each layer keeps a short full-precision residual of at most ``residual_length``
tokens. When it fills, whole multiples of ``residual_length`` tokens are encoded
by the codecs and appended to the layer's packed store
(:class:`kvcx.cache.store.PackedKV`: codes + FP16 scales + zero points, the exact
sink tokens) and dropped from the residual. Nothing is stored dequantized.

Attention over the store takes one of two paths per step, which the cache decides once per step
(at its first layer) and each layer applies with what it can do:

- fused (the model's attention set to ``"kvcx"``: single tokens, and on the CPU steps of a few hundred
  tokens over a packed history: a long prompt's later chunks, speculative decoding's drafts): the layer
  hands itself to the ``"kvcx"`` attention function (:mod:`kvcx.cache.attention_fn`), which runs the fused
  kernel over the packed store, the sinks and the residual (kvcx/codecs/cpu/attn*.h on the CPU, the Triton
  kernel of :mod:`kvcx.cache.device_store` on the device); no full-precision copy of the context exists;
- materialising (``fused=False``, other attention implementations, steps of more tokens than the kernel's
  rows): the layer decodes its packed store into one scratch buffer shared by all layers and hands
  ``[decoded, residual, new]`` to attention (a device store decodes on the device; a CPU store on a CUDA
  model decodes on the host and copies the scratch to the device).

Where the store lives: on the model's device with the Triton backend (:class:`DevicePackedKV`) when the
codecs run there (CUDA and 4-bit integer codes, or ``backend="triton"``), else on the host
(:class:`~kvcx.cache.store.PackedKV`, the CPU kernels).

A step of fewer than ``residual_length`` tokens stays in full precision until the next step, so that
``crop()`` can drop rejected draft tokens (speculative / assisted decoding); a longer step (a prompt
chunk, or generation-mode validation's chunks of ``residual_length``) is packed at once.

Control runs one way: the cache builds its layers with everything they share (scratch, the fused
kernel's workspace, the mask converter, the kernel timer) and calls them; a layer never reaches back.
torch and transformers are imported when this module is imported; the rest of kvcx never imports it
unless asked.
"""
from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import transformers
from transformers.cache_utils import Cache, DynamicLayer

from kvcx.cache.attention_fn import ATTN_IMPLEMENTATION, HANDOFF
from kvcx.cache.buffers import HeapRelease, MaskConverter, Scratch
from kvcx.cache.layer_config import fitted as _fitted, on_backend as _on_backend, pressed as _pressed
from kvcx.cache.pressing import PrefillPress
from kvcx.cache.fused import ATTN_MAX_ROWS, CAUSAL, NO_MASK, Workspace
from kvcx.cache.device_store import DevicePackedKV, attend_in_dtype, runs_on_device
from kvcx.cache.store import PackedKV
from kvcx.codecs.tensors import torch_to_numpy
from kvcx.codecs.backends import check_backend
from kvcx.codecs.dtypes import is_int
from kvcx.codecs.kvconfig import DEFAULT_SCHEME, KVConfig
from kvcx.codecs.presses import Press
from kvcx.codecs.runtime import resolve_threads
from kvcx.deps import check_transformers
from kvcx.errors import KvcxError, SlowPathWarning

check_transformers(transformers.__version__)


class KernelTimer:
    """Seconds spent in kvcx's kernels (encode, decode, fused attention) by one cache's layers."""

    def __init__(self):
        self.seconds = 0.0

    def add(self, seconds: float) -> None:
        self.seconds += seconds


_FALLBACK_HINT = "pass fused=None to fall back to materialising"


@dataclass(frozen=True)
class StepMode:
    """What the cache decided for one step: layer steps may run fused (one token, or a few hundred over a
    packed history) unless ``reason`` says why not; ``required`` (``KvcxCache(fused=True)``) makes a step that cannot run fused an error."""

    reason: Optional[str] = None
    required: bool = False
    kvcx_attention: bool = True   # the model's attention is "kvcx" (a press needs it)


class KvcxLayer(DynamicLayer):
    """One layer of a :class:`KvcxCache`: built with everything it shares with the other layers."""

    is_compileable = False

    def __init__(self, kv_config: KVConfig, residual_length: int, scratch: Scratch, workspace: Workspace,
                 masks: MaskConverter, timer: KernelTimer, heap: HeapRelease, query_group: int,
                 key_weights: Optional[np.ndarray] = None, layer_idx: int = 0, press: Optional[Press] = None):
        super().__init__()
        self.layer_idx = layer_idx
        self.kv_config = kv_config
        self.residual_length = residual_length
        self._scratch = scratch
        self._workspace = workspace
        self._masks = masks
        self._timer = timer
        self._heap = heap
        self._query_group = query_group
        first = {"key": kv_config.key, "value": kv_config.value}
        self._codecs_first = first
        # later chunks: the same codecs without sinks, and with the same threads
        self._codecs_next = {k: c.replace(**({"sinks": 0} if "sinks" in c.settings else {}))
                             for k, c in first.items()}
        self._key_weights = key_weights  # per-channel widths: how much the queries weigh each key channel
        self.n_threads = kv_config.value.n_threads
        self.store = None                 # PackedKV (NumPy, CPU kernels) or DevicePackedKV (on the device, Triton)
        self.on_device = False            # whether the store is the device one
        self.cumulative_length = 0
        self.steps = {"fused": 0, "materialised": 0, "full_precision": 0}
        self.last_step = 0   # tokens of the last step kept in full precision (crop() may drop them)
        self._unsupported: Optional[str] = None
        self._press = PrefillPress(press, layer_idx) if press is not None else None   # token eviction at prefill
        self._prefill = None   # the prefill's states, until the press has read the prompt's queries

    @property
    def fused_unsupported(self) -> Optional[str]:
        """Why this layer's stores cannot be read by the fused kernel (None when they can, or before its first
        step)."""
        return self._unsupported

    @property
    def quantized_length(self) -> int:
        """Tokens held packed (exact sink tokens included)."""
        return self.store.tokens if self.store is not None else 0

    # -- storage -------------------------------------------------------------
    def _encode(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        codecs = self._codecs_first if not len(self.store) else self._codecs_next
        t = time.perf_counter()
        if self.on_device:   # the Triton encoder, on the tensors where they are
            pk, pv = codecs["key"].encode(keys, name="key"), codecs["value"].encode(values, name="value")
        else:
            pk = codecs["key"].encode(torch_to_numpy(keys), name="key", weights=self._key_weights)
            pv = codecs["value"].encode(torch_to_numpy(values), name="value")
        self.store.append(pk, pv)
        self._timer.add(time.perf_counter() - t)
        self._unsupported = self._why_not_fused()

    def _why_not_fused(self) -> Optional[str]:
        """Why this layer's steps cannot run fused (None when they can)."""
        if self.on_device:
            return self.store.unsupported(self._query_group)
        if self.device.type != "cpu":
            return (f"fused attention over a CPU store runs on CPU tensors (this layer's codecs, "
                    f"{self.kv_config.key.describe()} / {self.kv_config.value.describe()}, have no {self.device.type} "
                    "backend)")
        return self.store.unsupported(self.store.keys.D, self._query_group)

    def pack_residual(self, keep: int = 0) -> None:
        """Pack the residual's whole multiples of residual_length tokens, leaving at least its last ``keep``
        tokens in full precision (the last step's, which crop() may still drop)."""
        n_res = self.keys.shape[-2] - keep
        if n_res >= self.residual_length:
            n_flush = (n_res // self.residual_length) * self.residual_length
            self._encode(self.keys[:, :, :n_flush], self.values[:, :, :n_flush])
            self.keys, self.values = _owned(self.keys[:, :, n_flush:]), _owned(self.values[:, :, n_flush:])
            if self.device.type == "cpu":   # the model's prefill temporaries are on the C heap
                self._heap.after_pack(n_flush)

    def _materialize(self, new_k: Optional[torch.Tensor], new_v: Optional[torch.Tensor]):
        """[dequantized chunks, residual, new tokens] for attention, in the shared scratch buffers."""
        B, H, _, D = self.keys.shape
        n_res = self.keys.shape[-2]
        n_new = new_k.shape[-2] if new_k is not None else 0
        total = self.quantized_length + n_res + n_new
        out = []
        for kind, res, new in (("key", self.keys, new_k), ("value", self.values, new_v)):
            host, dev = self._scratch.get(kind, (B, H, total, D), self.dtype, self.device, host=not self.on_device)
            t = time.perf_counter()
            if self.on_device:   # decoded by the Triton kernels into the device scratch
                off = self.store.decode_into(kind, dev)
            else:
                store = self.store.keys if kind == "key" else self.store.values
                # a view of the host scratch: decoding writes straight into it
                off = store.decode_into(torch_to_numpy(host), name=kind, n_threads=self.n_threads)
            self._timer.add(time.perf_counter() - t)
            if host is not None and dev is not host:   # a CPU store on a CUDA model: decoded context to the device
                dev[:, :, :off].copy_(host[:, :, :off])
            dev[:, :, off:off + n_res] = res
            if n_new:
                dev[:, :, off + n_res:] = new
            out.append(dev)
        return out[0], out[1]

    # -- transformers API --------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        if key_states.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise KvcxError(f"KvcxCache holds float32/float16/bfloat16 caches, got {key_states.dtype}")
        self.dtype, self.device = key_states.dtype, key_states.device
        B, H, _, D = key_states.shape
        self.keys = key_states.new_empty((B, H, 0, D))
        self.values = value_states.new_empty((B, H, 0, D))
        kc, vc = self._codecs_first["key"], self._codecs_first["value"]
        self.on_device = runs_on_device(kc, vc, self.device)
        self.store = DevicePackedKV(B, H, D, self.device) if self.on_device else \
            PackedKV(B * H, D, kc, vc, workspace=self._workspace)
        self._unsupported = self._why_not_fused()
        self.is_initialized = True

    def _check_states(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """KvcxError naming the layer when a step's states do not continue the cache (batch, heads, head dim,
        dtype, device), or keys and values differ in shape."""
        if not (isinstance(key_states, torch.Tensor) and isinstance(value_states, torch.Tensor)
                and key_states.dim() == 4 and key_states.shape == value_states.shape
                and key_states.dtype == value_states.dtype):
            raise KvcxError(f"KvcxCache layer {self.layer_idx}: keys {list(getattr(key_states, 'shape', []))} and "
                            f"values {list(getattr(value_states, 'shape', []))} must be tensors of one shape "
                            "[batch, kv_heads, tokens, head_dim] and one dtype")
        if self.is_initialized:
            B, H, _, D = self.keys.shape
            b, h, _, d = key_states.shape
            if (b, h, d) != (B, H, D) or key_states.dtype != self.dtype or key_states.device != self.device:
                raise KvcxError(f"KvcxCache layer {self.layer_idx}: this step's keys are {list(key_states.shape)} "
                                f"{key_states.dtype} on {key_states.device}, the cache holds [{B}, {H}, *, {D}] "
                                f"{self.dtype} on {self.device}; a cache serves one batch of one model: make a new "
                                "KvcxCache (or reset() this one)")

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, cache_kwargs=None,
               mode: StepMode = StepMode(reason="materialising")):
        """Add a step's keys and values. A step of one token (or of several over a packed history) runs fused
        when ``mode`` allows it and this layer's stores can be read by the fused kernel: the layer is then
        handed to the attention function (which calls :meth:`attend`), and the step's own states are
        returned."""
        self._check_states(key_states, value_states)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self._press is not None:
            self._press.check(key_states, mode.kvcx_attention)
            if self._press.due(self.cumulative_length, key_states.shape[-2]):   # the prefill: attended whole
                self.steps["full_precision"] += 1
                self._prefill = (key_states, value_states)
                HANDOFF.post(key_states, self, "press")
                return key_states, value_states
        self.pack_residual()  # what the last step left in full precision for crop() goes now
        Q = key_states.shape[-2]
        self.cumulative_length += Q
        self.last_step = Q if Q < self.residual_length else 0   # a longer step is a prompt chunk: packed now
        if self._fusable(Q) and self._takes_fused_step(mode):
            self._extend(key_states, value_states)
            HANDOFF.post(key_states, self)
            return key_states, value_states
        packed = len(self.store) > 0
        if packed:
            keys_out, values_out = self._materialize(key_states, value_states)
            self.steps["materialised"] += 1
        else:
            self.steps["full_precision"] += 1
        self._extend(key_states, value_states)
        if not packed:   # nothing packed yet: attention reads the residual itself
            keys_out, values_out = self.keys, self.values
        self.pack_residual(self.last_step)
        if self._press is not None:   # fewer tokens than the context: the mask comes from the layer
            HANDOFF.post(keys_out, self, "tail")
        return keys_out, values_out

    def press_prefill(self, query: torch.Tensor) -> None:
        """After the prefill's attention: keep what the press keeps of the prompt's states (SnapKV reads
        ``query``, the prompt's queries) and pack it."""
        keys, values = self._press.kept(*self._prefill, query)
        self._prefill = None
        self.cumulative_length += keys.shape[-2]
        self.last_step = 0
        self._extend(keys, values)
        self.pack_residual()

    def _extend(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Append the step's states to the residual (contiguous: the fused kernel reads it as an array). A
        prompt chunk (``residual_length`` tokens or more) after an empty residual is taken as it comes, without
        a copy where contiguous: it is packed before the step returns, and only the copy of its remainder stays."""
        if self.keys.shape[-2] == 0 and key_states.shape[-2] >= self.residual_length:
            self.keys, self.values = key_states.contiguous(), value_states.contiguous()
        else:
            self.keys = torch.cat([self.keys, key_states], dim=-2)
            self.values = torch.cat([self.values, value_states], dim=-2)

    def _fusable(self, Q: int) -> bool:
        """Whether a step of Q tokens may run fused: one token, or a few hundred over a packed history (a
        chunk of a long prompt, speculative decoding's draft tokens) within the kernel's rows."""
        if self.on_device:   # the Triton kernel runs single-token steps; longer ones decode into device scratch
            return Q == 1
        return Q == 1 or (len(self.store) > 0 and 0 < Q * self._query_group <= ATTN_MAX_ROWS)

    def _takes_fused_step(self, mode: StepMode) -> bool:
        if mode.reason or self._unsupported:
            if mode.required:
                raise KvcxError(mode.reason or f"KvcxCache(fused=True): {self._unsupported}; {_FALLBACK_HINT}")
            return False
        self._scratch.release()  # fused steps need no full-precision copy of the context
        return True

    def attend(self, query: torch.Tensor, attention_mask: Optional[torch.Tensor], scaling: float) -> torch.Tensor:
        """The fused step: the step's query tokens (one per row when decoding) against the packed store and the
        residual (the step's own tokens its last, causal among them).

        Returns the attention output as transformers' attention functions do: [B, Q, Hq, D]."""
        if self.on_device:
            return self._attend_on_device(query, attention_mask, scaling)
        # every step of every layer comes here: the arrays are built to the kernel's contract (float32,
        # C-contiguous, the shapes PackedKV.step checks), so the step skips PackedKV.attend's type checks
        B, Hq, Q, D = query.shape
        fp32 = query.dtype == torch.float32
        q = (query if fp32 else query.float()).contiguous().numpy().reshape(B, Hq * Q, D)
        keys, values = (self.keys, self.values) if self.keys.dtype == torch.float32 else \
            (self.keys.float(), self.values.float())
        N, nr = B * keys.shape[1], keys.shape[2]
        rk, rv = keys.numpy().reshape(N, nr, D), values.numpy().reshape(N, nr, D)
        if attention_mask is None or self._press is not None:   # a pressed cache serves one unpadded sequence
            mask = CAUSAL if Q > 1 else NO_MASK
        else:
            if attention_mask.shape[-1] != self.cumulative_length:
                raise KvcxError(f"the attention mask covers {attention_mask.shape[-1]} tokens but the cache holds "
                                f"{self.cumulative_length}; pass the mask generate() builds")
            mask = self._masks.convert(attention_mask, B, Q)
        out = np.empty((B, Hq * Q, D), dtype=np.float32)
        t = time.perf_counter()
        self.store.step(q, rk, rv, mask, scaling, resolve_threads(self.n_threads), out, Q)
        self._timer.add(time.perf_counter() - t)
        self.steps["fused"] += 1
        self.pack_residual(self.last_step)
        out = torch.from_numpy(out).view(B, Hq, Q, D).transpose(1, 2)
        return out if fp32 else out.to(query.dtype)

    def _attend_on_device(self, query: torch.Tensor, attention_mask: Optional[torch.Tensor], scaling: float):
        """The fused single-token step over the device store (the Triton kernel), as :meth:`attend`."""
        B, Hq, _, D = query.shape
        add = None
        if attention_mask is not None and self._press is None:
            add = self._masks.additive(attention_mask, B, self.cumulative_length)
        t = time.perf_counter()
        out = attend_in_dtype(query, lambda o: self.store.attend(query.reshape(B, Hq, D), self.keys, self.values,
                                                                 add, scaling, out=o))
        self._timer.add(time.perf_counter() - t)
        self.steps["fused"] += 1
        self.pack_residual(self.last_step)
        return out

    def materialised_step(self):
        """Keys and values of every held token for a step the fused kernel cannot run (counted as such)."""
        self.steps["materialised"] += 1
        return self.full_states()

    def full_states(self):
        """Keys and values of every held token, materialised (for attention features the kernel lacks)."""
        return self._materialize(None, None)

    def get_seq_length(self) -> int:
        """Tokens of the context this layer stands for (those a press evicted included: positions go on)."""
        return self.cumulative_length + (self._press.evicted if self._press is not None else 0)

    def get_mask_sizes(self, query_length: int) -> tuple:
        """(kv_length, kv_offset) for transformers' masks: the held tokens, after those a press evicted."""
        return self.cumulative_length + query_length, self._press.evicted if self._press is not None else 0

    def reset(self) -> None:
        super().reset()
        self.store = None
        self.cumulative_length = 0
        self.last_step = 0
        if self._press is not None:
            self._press = PrefillPress(self._press.press, self.layer_idx)

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` tokens (transformers' convention: a negative count), e.g. the draft
        tokens speculative decoding rejected. Only tokens still in full precision can go: a step's own tokens
        (fewer than residual_length of them) stay unpacked until the next step."""
        if tokens_to_remove > 0:
            raise KvcxError(f"crop({tokens_to_remove}): pass a negative count of tokens to remove, as "
                            "transformers' caches take it")
        n = -int(tokens_to_remove)
        if n == 0 or not self.is_initialized:
            return
        n_res = self.keys.shape[-2]
        if n > n_res:
            raise KvcxError(f"KvcxCache layer {self.layer_idx}: cannot remove {n} tokens, only the last {n_res} are "
                            f"still in full precision (the others are packed, append-only); speculative decoding "
                            f"with residual_length={self.residual_length} draft tokens or more needs a larger "
                            "residual_length")
        self.keys, self.values = _owned(self.keys[:, :, :n_res - n]), _owned(self.values[:, :, :n_res - n])
        self.cumulative_length -= n
        self.last_step = max(0, self.last_step - n)

    def reorder_cache(self, beam_idx) -> None:
        raise KvcxError("KvcxCache does not support beam search yet; use greedy or sampling decoding")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise KvcxError("KvcxCache does not support batch expansion (num_return_sequences > 1 / beam search)")

    def batch_select_indices(self, indices) -> None:
        raise KvcxError("KvcxCache does not support selecting batch rows")

    # -- accounting -----------------------------------------------------------
    def packed_bytes(self) -> int:
        """Bytes of the packed store (codes, scales, zero points, sinks, the head rows attention reads)."""
        return self.store.nbytes if self.store is not None else 0

    def residual_bytes(self) -> int:
        """Bytes the full-precision residual holds (its tensors' whole storage)."""
        if not self.is_initialized:
            return 0
        return self.keys.untyped_storage().nbytes() + self.values.untyped_storage().nbytes()


class KvcxCache(Cache):
    """A packed KV cache for ``model.generate(..., past_key_values=KvcxCache(model.config))``.

    Parameters
    ----------
    config: the model's config (its decoder text config is used for the layer count).
    group_size, scheme, bits, sinks, rotate: the codec, as for ``kvcx compress`` (default: the kvcx scheme).
    residual_length: tokens kept in full precision before they are packed (a multiple of the
        group size when keys are grouped per channel).
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
        the Triton kernels, with the store on the GPU, for 4-bit integer codecs where triton is installed;
        CPU: the CPU kernels); ``"triton"`` forces the device store and the Triton kernels (Triton's
        interpreter runs them on CPU tensors); ``"cpu"`` keeps the store on the host and the CPU kernels.
    """

    def __init__(self, config, group_size: Optional[int] = None, scheme: str = DEFAULT_SCHEME,
                 residual_length: int = 64, bits: Optional[int] = None, sinks: Optional[int] = None, rotate: Optional[bool] = None,
                 kv_config: Optional[KVConfig] = None, n_threads: Optional[int] = None,
                 fused: Optional[bool] = None, backend: Optional[str] = None, release_heap: bool = True):
        kv_config, press, scheme = _pressed(kv_config, scheme)   # a press composed by '+' (or a plan's)
        kv = kv_config or KVConfig.from_scheme(scheme, group_size=group_size, bits=bits, sinks=sinks, rotate=rotate,
                                               n_threads=n_threads)
        if kv_config is not None and n_threads is not None:  # n_threads applies to a ready config too
            kv = kv.with_threads(n_threads)
        if isinstance(residual_length, bool) or not isinstance(residual_length, int) or residual_length < 1:
            raise KvcxError(f"residual_length must be a positive integer, got {residual_length!r}")
        for c in (kv.key, kv.value):
            if residual_length % c.token_block:
                raise KvcxError(f"residual_length ({residual_length}) must be a multiple of the group size "
                                f"({c.token_block}) when grouping per channel, so every packed group is full")
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        layer_types = getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers
        bad = set(layer_types) - {"full_attention"}
        if bad:
            raise KvcxError(f"KvcxCache supports full-attention models only; this model has {sorted(bad)} layers")
        if fused not in (None, True, False):
            raise KvcxError(f"fused must be None (automatic), True or False, got {fused!r}")
        if not isinstance(release_heap, bool):
            raise KvcxError(f"release_heap must be True or False, got {release_heap!r}")
        if backend is not None:
            kv = _on_backend(kv, check_backend(backend), text.num_hidden_layers)
        heads = getattr(text, "num_attention_heads", None)
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        head_dim = getattr(text, "head_dim", None) or (text.hidden_size // heads if heads else None)
        self.kv_config = kv
        self.residual_length = residual_length
        self.fused = fused
        self.query_group = heads // kv_heads if heads and kv_heads and heads % kv_heads == 0 else 0
        self._config = text
        self._timer = KernelTimer()
        self._scratch = Scratch()
        self._masks = MaskConverter()
        self._heap = HeapRelease(enabled=release_heap)
        self._mode: Optional[StepMode] = None   # this step's, decided at its first layer
        self._hinted = False                    # told how to turn the fused path on (once per cache)
        workspace = Workspace()  # the fused kernel's scratch, one for all layers
        super().__init__(layers=[KvcxLayer(_fitted(kv.for_layer(i), kv_heads, residual_length, head_dim),
                                           residual_length, self._scratch, workspace, self._masks, self._timer,
                                           self._heap, self.query_group, kv.weights_for(f"layer_{i}_key"),
                                           layer_idx=i, press=press)
                                 for i in range(text.num_hidden_layers)])
        self._workspace = workspace
        self.press = press

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
        if self.fused is not None or impl == ATTN_IMPLEMENTATION or self.layers[0].fused_unsupported:
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
        if layer_idx == 0 or self._mode is None:
            self._mode = self._step_mode(key_states)
            if not self._hinted and key_states.shape[-2] == 1:
                self._hint_fused(key_states)
        return self.layers[layer_idx].update(key_states, value_states, mode=self._mode)

    def memory_report(self) -> dict:
        """Bytes the cache holds, counted whole: packed stores + full-precision residual + the
        materialising path's full-precision scratch (released by fused steps) and the last step's
        attention mask (scratch_bytes) + the fused kernel's workspace (a few KiB per task, shared by
        the layers).

        ``attention_steps``: layer steps per path (fused kernel, materialised scratch, or all full precision).
        ``heap_releases``: times a layer handed the C heap's free pages back after packing a prompt chunk
        (``release_heap``)."""
        packed = sum(layer.packed_bytes() for layer in self.layers)
        residual = sum(layer.residual_bytes() for layer in self.layers)
        scratch = self._scratch.nbytes() + self._masks.nbytes()
        workspace = self._workspace.nbytes
        values = 0
        for layer in self.layers:
            if layer.is_initialized:
                B, H, _, D = layer.keys.shape
                values += 2 * B * H * layer.get_seq_length() * D   # the whole context's, evicted tokens included
        steps = {k: sum(layer.steps[k] for layer in self.layers) for k in ("fused", "materialised", "full_precision")}
        return {"packed_bytes": packed, "residual_bytes": residual, "scratch_bytes": scratch,
                "workspace_bytes": workspace, "total_bytes": packed + residual + scratch + workspace,
                "tokens": self.get_seq_length(),
                "attention_steps": steps,
                "fp16_equivalent_bytes": 2 * values,
                "model_dtype_equivalent_bytes": values * (self.layers[0].dtype.itemsize
                                                          if self.layers and self.layers[0].is_initialized else 2),
                "bits_per_value": 8.0 * (packed + residual) / values if values else 0.0,
                "backend": self.backend, "heap_releases": self._heap.count}

    def nbytes(self) -> int:
        return self.memory_report()["total_bytes"]

    @property
    def backend(self) -> str:
        """Where the layers' packed stores are and which kernels run: "triton" (on the device), "cpu", both
        ("cpu+triton": a plan whose layers differ), or "" before the first step."""
        return "+".join(sorted({"triton" if layer.on_device else "cpu" for layer in self.layers
                                if layer.is_initialized}))


def _owned(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of a slice of the residual that holds only its own elements. ``.contiguous()`` would
    return the slice itself where it already is contiguous (every packed token dropped, or one KV head), and
    keep the whole step's storage alive: an 8,000-token prompt packed whole kept 12 MB a layer in FP32."""
    return t.clone(memory_format=torch.contiguous_format)


def dynamic_cache_bytes(cache) -> int:
    """Bytes held by a transformers DynamicCache (keys + values of every layer)."""
    return int(sum(layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()
                   for layer in cache.layers))
