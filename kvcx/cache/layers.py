"""A :class:`~kvcx.cache.KvcxCache`'s full-attention layer, :class:`KvcxLayer` (every token packed): the base of
:class:`~kvcx.cache.window_layer.KvcxWindowLayer` (sliding and chunked attention: the window's tokens packed, older
blocks dropped).

Each layer keeps a short full-precision residual of at most ``residual_length`` tokens. When it fills, whole
multiples of ``residual_length`` tokens are encoded by the codecs and appended to the layer's packed store
(:class:`kvcx.cache.store.PackedKV` on the host, :class:`kvcx.cache.device_store.DevicePackedKV` on the device, or
:class:`~kvcx.cache.device_store.DeviceChunkKV` there for codecs the fused attention does not read: codes + FP16
scales + zero points, the exact sink tokens) and dropped from the residual. Nothing is stored
dequantized.

A step runs fused (the layer posts itself for the ``"kvcx"`` attention function: :mod:`kvcx.cache.attention_fn`'s
contract) or materialises (the layer decodes its store into one scratch buffer shared by all layers and returns
``[decoded, residual, new]`` from ``update()``, as transformers' layers return the context).

An MLA layer's decode step under the ``"kvcx"`` attention returns the step's own latent and posts itself as a
"latent" step (:mod:`kvcx.cache.attention_fn`): the attention reads the layer's decoded latent with the model's
``kv_b_proj`` absorbed (:mod:`kvcx.cache.latent`), so the model expands one token, not the context.

Control runs one way: the cache builds its layers with everything they share (scratch, the fused kernel's
workspace, the mask converter, the kernel timer) and calls them; a layer never reaches back.
"""
from __future__ import annotations

import time
from typing import Optional

import numpy as np
import torch
from transformers.cache_utils import DynamicLayer

from kvcx.cache.attention_fn import HANDOFF, LATENT
from kvcx.cache.buffers import FALLBACK_HINT, Shared, StepMode
from kvcx.cache.device_store import DeviceChunkKV, DevicePackedKV, attend_in_dtype, decodes_on_device, runs_on_device
from kvcx.cache.fused import ATTN_MAX_ROWS, CAUSAL, NO_MASK, step_mask
from kvcx.cache.layer_types import LayerSpec
from kvcx.cache.pressing import PrefillPress
from kvcx.cache.store import PackedKV
from kvcx.codecs.runtime import resolve_threads
from kvcx.codecs.tensors import torch_to_numpy
from kvcx.errors import KvcxError


class KvcxLayer(DynamicLayer):
    """One full-attention layer of a :class:`KvcxCache`: every token, packed."""

    is_compileable = False
    # an MLA layer's LatentStep advice, where the model's module can neither be absorbed nor expand the latent
    unexpandable_fix = ("build the cache with KvcxCache(..., fused=False) (every step returns the decoded context "
                        "for the model to expand)")

    def __init__(self, kv_config, residual_length: int, shared: Shared, spec: LayerSpec,
                 key_weights: Optional[np.ndarray] = None, press=None, rope_codec=None):
        """``kv_config``: the layer's :class:`~kvcx.codecs.KVConfig`; ``press``: a
        :class:`~kvcx.presses.Press` run at the prefill (full layers), or None; ``rope_codec``: an MLA layer's
        codec for its shared RoPE key (the values transformers hands it), in place of the config's value codec
        (:func:`kvcx.cache.layer_config.latent_rope_codec`)."""
        super().__init__()
        self.spec = spec
        self.layer_idx = spec.index
        self.kv_config = kv_config
        self.residual_length = residual_length
        self._shared = shared
        self._scratch, self._workspace, self._masks = shared.scratch, shared.workspace, shared.masks
        self._timer, self._heap = shared.timer, shared.heap
        self._query_group = spec.query_group
        first = {"key": kv_config.key, "value": kv_config.value if rope_codec is None else rope_codec}
        # later chunks: the same codecs without sinks, and with the same threads
        nxt = {k: c.replace(**({"sinks": 0} if "sinks" in c.settings else {})) for k, c in first.items()}
        self._codecs_first = first if self.keeps_sinks else nxt
        self._codecs_next = nxt
        self._key_weights = key_weights  # per-channel widths: how much the queries weigh each key channel
        self.n_threads = kv_config.value.n_threads
        self.store = None                 # PackedKV (NumPy, CPU kernels), or on the device (Triton): DevicePackedKV
        #                                   (the fused attention reads it) or DeviceChunkKV (decoded there to attend)
        self.on_device = False            # whether the store is a device one
        self.cumulative_length = 0
        self.steps = {"fused": 0, "materialised": 0, "full_precision": 0}
        if spec.latent:   # MLA: of the steps that decoded the latent, those attended with kv_b_proj absorbed
            self.steps["absorbed"] = 0
        self._latent_form = False   # MLA: the model hands this layer its latent and RoPE key (transformers >= 5.17)
        self.last_step = 0   # tokens of the last step kept in full precision (crop() may drop them)
        self._step = 0       # tokens of the step being run (its own are the residual's last)
        self._unsupported: Optional[str] = None
        self._sinks = None   # (the model's sinks tensor, its version, float32 array, float32 on its device): once
        self._press = PrefillPress(press, spec.index) if press is not None else None   # token eviction at prefill
        self._prefill = None   # the prefill's states, until the press has read the prompt's queries

    # a full layer keeps the codecs' exact sink tokens (a window leaves them behind: a windowed layer does not)
    keeps_sinks = True

    def codecs_described(self) -> dict:
        """The codecs this layer packs with, described: {"keys", "values"}, or for an MLA layer {"latent",
        "rope_key"} (what transformers hands its cache as keys and as values)."""
        names = ("latent", "rope_key") if self.spec.latent else ("keys", "values")
        return {n: self._codecs_first[k].describe() for n, k in zip(names, ("key", "value"))}

    @property
    def fused_unsupported(self) -> Optional[str]:
        """Why this layer's steps cannot run fused (None when they can, or before its first step)."""
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
            pk = codecs["key"].encode(keys, name="key", weights=self._key_weights)
            pv = codecs["value"].encode(values, name="value")
        else:
            pk = codecs["key"].encode(torch_to_numpy(keys), name="key", weights=self._key_weights)
            pv = codecs["value"].encode(torch_to_numpy(values), name="value")
        self.store.append(pk, pv)
        self._timer.add(time.perf_counter() - t)
        self._unsupported = self._why_not_fused()

    def _why_not_fused(self) -> Optional[str]:
        """Why this layer's steps cannot run fused (None when they can)."""
        if self.spec.latent:
            return ("MLA: the model expands the cached latent into keys and values after the cache (kv_b_proj), so "
                    "no kernel can attend over the packed codes: this layer's steps decode its packed latent"
                    + (", and under the 'kvcx' attention (unless fused=False) a decode step attends over it with "
                       "kv_b_proj absorbed into the query and the output (the context is never expanded)"
                       if self._latent_form else ""))
        if self.on_device:
            return self.store.unsupported(self._query_group)
        if self.device.type != "cpu":
            return (f"fused attention over a CPU store runs on CPU tensors (this layer's codecs, "
                    f"{' / '.join(self.codecs_described().values())}, have no {self.device.type} "
                    "backend)")
        return self.store.unsupported(self.store.keys.D, self._query_group)

    def pack_residual(self, keep: int = 0) -> None:
        """Pack the residual's whole multiples of residual_length tokens, leaving at least its last ``keep``
        tokens in full precision (the last step's, which crop() may still drop)."""
        n_res = self.keys.shape[-2] - keep
        if n_res >= self.residual_length:
            n_flush = (n_res // self.residual_length) * self.residual_length
            self._encode(self.keys[:, :, :n_flush], self.values[:, :, :n_flush])
            self.keys, self.values = owned(self.keys[:, :, n_flush:]), owned(self.values[:, :, n_flush:])
            if self.device.type == "cpu":   # the model's prefill temporaries are on the C heap
                self._heap.after_pack(n_flush)

    def _materialize(self, new_k: Optional[torch.Tensor], new_v: Optional[torch.Tensor]):
        """[dequantized chunks, residual, new tokens] for attention, in the shared scratch buffers."""
        B, H, n_res, _ = self.keys.shape
        n_new = new_k.shape[-2] if new_k is not None else 0
        total = self.quantized_length + n_res + n_new
        out = []
        for kind, res, new in (("key", self.keys, new_k), ("value", self.values, new_v)):
            shape = (B, H, total, res.shape[-1])
            if self.spec.shared:   # later layers read what this step returns: its own buffers, not the shared ones
                dev = torch.empty(shape, dtype=self.dtype, device=self.device)
                host = dev if self.device.type == "cpu" or self.on_device else torch.empty(shape, dtype=self.dtype)
                host = None if self.on_device else host
            else:
                host, dev = self._scratch.get(kind, shape, self.dtype, self.device, host=not self.on_device)
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
        return self._visible(out[0], out[1])

    def _visible(self, keys: torch.Tensor, values: torch.Tensor):
        """Of every held token's keys and values (the step's own last), those the step attends to (all of them
        here; a window's from its first token)."""
        return keys, values

    # -- transformers API --------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        if key_states.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise KvcxError(f"KvcxCache layer {self.layer_idx}: holds float32/float16/bfloat16 caches, got "
                            f"{key_states.dtype}")
        self.dtype, self.device = key_states.dtype, key_states.device
        B, H, _, D = key_states.shape
        Dv = value_states.shape[-1]
        self.keys = key_states.new_empty((B, H, 0, D))
        self.values = value_states.new_empty((B, H, 0, Dv))
        kc, vc = self._codecs_first["key"], self._codecs_first["value"]
        self._latent_form = self.spec.latent and H == 1 and self.spec.latent_widths == (D, Dv)
        fused_there = runs_on_device(kc, vc, self.device) and D == Dv
        self.on_device = fused_there or decodes_on_device(kc, vc, self.device, same_width=D == Dv)
        self.store = DevicePackedKV(B, H, D, self.device) if fused_there else \
            DeviceChunkKV(B, H, kc, vc, self.device) if self.on_device else \
            PackedKV(B * H, D, kc, vc, workspace=self._workspace, value_dim=Dv)
        self._unsupported = self._why_not_fused()
        self.is_initialized = True

    def _check_states(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """KvcxError naming the layer when a step's states do not continue the cache (batch, heads, head dim,
        dtype, device), keys and values differ in shape, or the layer's config says other heads or widths."""
        spec = self.spec
        if not (isinstance(key_states, torch.Tensor) and isinstance(value_states, torch.Tensor)
                and key_states.dim() == 4 and value_states.dim() == 4
                and key_states.shape[:3] == value_states.shape[:3] and key_states.dtype == value_states.dtype
                and (key_states.shape[-1] == value_states.shape[-1] or spec.key_dim != spec.value_dim
                     or spec.latent)):
            raise KvcxError(f"KvcxCache layer {self.layer_idx}: keys {list(getattr(key_states, 'shape', []))} and "
                            f"values {list(getattr(value_states, 'shape', []))} must be tensors of one shape "
                            "[batch, kv_heads, tokens, head_dim] and one dtype")
        if not self.is_initialized:
            h, dk, dv = key_states.shape[1], key_states.shape[-1], value_states.shape[-1]
            want = (spec.kv_heads or h, spec.key_dim or dk, spec.value_dim or dv)
            if (h, dk, dv) != want:
                raise KvcxError(f"KvcxCache {spec.describe()}: the model hands this layer {h} KV heads of keys {dk} "
                                f"and values {dv} wide, its config says {want[0]} of {want[1]} and {want[2]}: build "
                                "the cache from the model's own config (model.config), or fix the config")
            return
        B, H, _, D = self.keys.shape
        b, h, _, d = key_states.shape
        if (b, h, d) != (B, H, D) or value_states.shape[-1] != self.values.shape[-1] \
                or key_states.dtype != self.dtype or key_states.device != self.device:
            raise KvcxError(f"KvcxCache layer {self.layer_idx}: this step's keys are {list(key_states.shape)} "
                            f"{key_states.dtype} on {key_states.device}, the cache holds [{B}, {H}, *, {D}] "
                            f"{self.dtype} on {self.device}; a cache serves one batch of one model: make a new "
                            "KvcxCache (or reset() this one)")

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, cache_kwargs=None,
               mode: StepMode = StepMode(reason="materialising")):
        """Add a step's keys and values. A step of one token (or of several over a packed history) runs fused
        when ``mode`` allows it and this layer's stores can be read by the fused kernel: the layer is then
        posted for the attention function (which calls :meth:`attend`), and the step's own states are
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
        self._step = Q
        self.last_step = Q if Q < self.residual_length else 0   # a longer step is a prompt chunk: packed now
        if self._fusable(Q) and self._takes_fused_step(mode):
            self._extend(key_states, value_states)
            HANDOFF.post(key_states, self)
            return key_states, value_states
        if self._latent_form:   # MLA: the step's own latent, the attention reading the rest; or no latent step
            if self._absorbs(Q, mode):
                self._extend(key_states, value_states)
                HANDOFF.post(key_states, self, LATENT)
                return key_states, value_states
            HANDOFF.drop_latent(self.layer_idx)
        packed = len(self.store) > 0
        if packed:
            keys_out, values_out = self._materialize(key_states, value_states)
            self.steps["materialised"] += 1
        else:
            self.steps["full_precision"] += 1
        self._extend(key_states, value_states)
        if not packed:   # nothing packed yet: attention reads the residual itself
            keys_out, values_out = self._visible(self.keys, self.values)
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

    def _absorbs(self, Q: int, mode: StepMode) -> bool:
        """Whether an MLA step of Q tokens attends over the latent (:meth:`latent_states`) in the ``"kvcx"``
        attention: one token, or fewer than the residual over a packed history (draft tokens), the model's
        attention "kvcx", nothing asking for the materialising path (``fused=False``) and no press (its mask is the
        layer's own); the model then expands the step's own tokens alone."""
        return (mode.kvcx_attention and not mode.reason and self._press is None
                and (Q == 1 or (len(self.store) > 0 and Q < self.residual_length)))

    def _takes_fused_step(self, mode: StepMode) -> bool:
        if mode.reason or self._unsupported:
            if mode.required:
                raise KvcxError(mode.reason or f"KvcxCache(fused=True) layer {self.layer_idx}: {self._unsupported}; "
                                f"{FALLBACK_HINT}")
            return False
        self._scratch.release()  # fused steps need no full-precision copy of the context
        return True

    # -- the fused step (attention_fn's FusedStep) ---------------------------------------------------------------
    def _window(self, Q: int, attention_mask: Optional[torch.Tensor]):
        """(packed tokens not read, residual tokens not read, a boolean band [1, Q, kv_len] the step needs beyond
        transformers' mask or None) of a step of Q tokens: a full layer reads everything it holds."""
        return 0, 0, None

    def _mask_length(self, Q: int) -> int:
        """The key length of transformers' mask for this layer's step of Q tokens (get_mask_sizes')."""
        return self.cumulative_length

    def _sink_logits(self, sinks: Optional[torch.Tensor], Hq: int, on_device: bool = False):
        """The model's per-head sink logits as float32 [Hq]: a NumPy array, or ``on_device`` a tensor where the
        parameter is (checked and converted once: the same parameter every step)."""
        if sinks is None:
            return None
        held = self._sinks
        if held is None or held[0] is not sinks or held[1] != sinks._version:
            flat = sinks.detach().float().reshape(-1).contiguous()
            arr = flat.cpu().numpy().copy()
            if arr.shape != (Hq,) or np.isnan(arr).any() or np.isposinf(arr).any():
                raise KvcxError(f"KvcxCache layer {self.layer_idx}: the model's attention sinks (s_aux) are "
                                f"{list(sinks.shape)}, not one finite logit per query head ({Hq}): check the model")
            self._sinks = held = (sinks, sinks._version, arr, flat)
        return held[3] if on_device else held[2]

    def attend(self, query: torch.Tensor, attention_mask: Optional[torch.Tensor], scaling: float, *,
               softcap: Optional[float] = None, sinks: Optional[torch.Tensor] = None,
               sliding_window: Optional[int] = None) -> torch.Tensor:
        """The fused step (:class:`~kvcx.cache.attention_fn.FusedStep`): the step's query tokens (one per row when
        decoding) against the packed store and the residual (the step's own tokens its last, causal among them),
        softcapped and with sinks where the model asks.

        Returns the attention output as transformers' attention functions do: [B, Q, Hq, Dv]."""
        B, Hq, Q, D = query.shape
        H = self.keys.shape[1]
        if Hq % H or (self._query_group and Hq // H != self._query_group) or D != self.keys.shape[-1]:
            raise KvcxError(f"KvcxCache {self.spec.describe()}: the model's queries are {Hq} heads of {D}, the layer "
                            f"holds {H} KV heads of {self.keys.shape[-1]} and its config says "
                            f"{self._query_group or '?'} query heads a KV head; build the cache from model.config")
        self._check_window(sliding_window)
        skip, rskip, band = self._window(Q, attention_mask)
        if self.on_device:
            return self._attend_on_device(query, attention_mask, scaling, softcap, sinks, skip, rskip)
        # every step of every layer comes here: the arrays are built to the kernel's contract (float32,
        # C-contiguous, the shapes PackedKV.step checks), so the step skips PackedKV.attend's type checks
        fp32 = query.dtype == torch.float32
        q = (query if fp32 else query.float()).contiguous().numpy().reshape(B, Hq * Q, D)
        keys, values = self.keys, self.values
        if rskip:   # the window starts in the residual
            keys, values = keys[:, :, rskip:], values[:, :, rskip:]
        keys, values = (keys.float(), values.float()) if keys.dtype != torch.float32 else (keys, values)
        keys, values = keys.contiguous(), values.contiguous()
        N, nr = B * keys.shape[1], keys.shape[2]
        rk, rv = keys.numpy().reshape(N, nr, D), values.numpy().reshape(N, nr, values.shape[-1])
        if band is not None:
            mask = step_mask(band, B, Q)
        elif attention_mask is None or self._press is not None:   # a pressed cache serves one unpadded sequence
            mask = CAUSAL if Q > 1 else NO_MASK
        else:
            want = self._mask_length(Q)
            if attention_mask.shape[-1] != want:
                raise KvcxError(f"KvcxCache layer {self.layer_idx}: the attention mask covers "
                                f"{attention_mask.shape[-1]} tokens but this step reads {want}; pass the mask "
                                "generate() builds (and the model's own config to the cache)")
            mask = self._masks.convert(attention_mask, B, Q)
        out = np.empty((B, Hq * Q, rv.shape[-1]), dtype=np.float32)
        t = time.perf_counter()
        self.store.step(q, rk, rv, mask, scaling, resolve_threads(self.n_threads), out, Q,
                        self._sink_logits(sinks, Hq), float(softcap or 0.0), skip)
        self._timer.add(time.perf_counter() - t)
        self.steps["fused"] += 1
        self.pack_residual(self.last_step)
        out = torch.from_numpy(out).view(B, Hq, Q, -1).transpose(1, 2)
        return out if fp32 else out.to(query.dtype)

    def _check_window(self, sliding_window: Optional[int]) -> None:
        """A full layer: the model's attention names no window for it."""
        if sliding_window:
            raise KvcxError(f"KvcxCache {self.spec.describe()}: the model attends this layer over a sliding window of "
                            f"{sliding_window} tokens, its config's layer_types say full attention: build the cache "
                            "from the model's own config (model.config)")

    def _attend_on_device(self, query: torch.Tensor, attention_mask: Optional[torch.Tensor], scaling: float,
                          softcap: Optional[float], sinks: Optional[torch.Tensor], skip: int, rskip: int):
        """The fused single-token step over the device store (the Triton kernels), as :meth:`attend`: a window's
        packed tokens before its first one masked (-inf; a window holds at most a chunk of them), its residual
        tokens before it left out, softcapping in both kernels, sinks in the merge."""
        B, Hq, _, D = query.shape
        keys, values = self.keys, self.values
        if rskip:
            keys, values = keys[:, :, rskip:].contiguous(), values[:, :, rskip:].contiguous()
        kv_len = self.store.tokens + keys.shape[2]
        add = None
        if attention_mask is not None and self._press is None:
            add = self._masks.additive(attention_mask, B, kv_len - skip)
        if skip:   # the packed tokens before the window's first one
            full = torch.zeros(B, kv_len, dtype=torch.float32, device=query.device)
            full[:, :skip] = float("-inf")
            if add is not None:
                full[:, skip:] += add
            add = full
        logits = self._sink_logits(sinks, Hq, on_device=True)
        t = time.perf_counter()
        out = attend_in_dtype(query, lambda o: self.store.attend(query.reshape(B, Hq, D), keys, values, add, scaling,
                                                                 out=o, sink_logits=logits,
                                                                 softcap=float(softcap or 0.0),
                                                                 launch=self._shared.launch))
        self._timer.add(time.perf_counter() - t)
        self.steps["fused"] += 1
        self.pack_residual(self.last_step)
        return out

    def latent_states(self, attention_mask):
        """An MLA step posted as "latent" (:class:`~kvcx.cache.attention_fn.LatentStep`): the latent and the RoPE
        key of every token the step attends to (the packed ones decoded into the scratch, the residual, the step's
        own last), and transformers' mask as given (its tokens are in that order)."""
        if not len(self.store):   # nothing packed yet: the residual holds the context
            self.steps["full_precision"] += 1
            return self.keys, self.values, attention_mask
        self.steps["materialised"] += 1
        return (*self._materialize(None, None), attention_mask)

    def after_latent(self, absorbed: bool) -> None:
        """After a latent step's attention (``absorbed``: over the latent with kv_b_proj absorbed; else over the
        module's expansion of it): the residual's whole groups packed."""
        if absorbed:
            self.steps["absorbed"] += 1
        self.pack_residual(self.last_step)

    def materialised_step(self):
        """Keys and values of every token a posted step attends to, for a step the fused kernel cannot run
        (counted as such)."""
        self.steps["materialised"] += 1
        return self.full_states()

    def after_materialised(self) -> None:
        """After a posted step's attention over the materialised context: the residual's whole groups packed."""
        self.pack_residual(self.last_step)

    def full_states(self):
        """Keys and values of every token the current step attends to, materialised (for attention features the
        kernel lacks)."""
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
        self.last_step = self._step = 0
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
        if n > self._croppable():
            raise KvcxError(f"KvcxCache layer {self.layer_idx}: cannot remove {n} tokens, only the last "
                            f"{self._croppable()} are still in full precision (the others are packed, append-only"
                            f"{'; a window keeps no more than the last step' if self.is_sliding else ''}); "
                            f"speculative decoding with residual_length={self.residual_length} draft tokens or "
                            "more needs a larger residual_length")
        self.keys, self.values = owned(self.keys[:, :, :n_res - n]), owned(self.values[:, :, :n_res - n])
        self.cumulative_length -= n
        self.last_step = max(0, self.last_step - n)

    def _croppable(self) -> int:
        """Tokens crop() can remove: those still in full precision."""
        return self.keys.shape[-2]

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

    def equivalent_values(self) -> int:
        """Values transformers' DynamicCache holds for this layer's context (keys and values): every token's."""
        if not self.is_initialized:
            return 0
        B, H = self.keys.shape[:2]
        return B * H * self.get_seq_length() * (self.keys.shape[-1] + self.values.shape[-1])


def owned(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of a slice of the residual that holds only its own elements. ``.contiguous()`` would
    return the slice itself where it already is contiguous (every packed token dropped, or one KV head), and
    keep the whole step's storage alive: an 8,000-token prompt packed whole kept 12 MB a layer in FP32."""
    return t.clone(memory_format=torch.contiguous_format)
