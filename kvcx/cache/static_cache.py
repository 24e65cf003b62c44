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

Hybrid models (:mod:`kvcx.cache.layer_types` reads their config as transformers' StaticCache does): the full-attention
layers are packed as above; linear-attention and recurrent layers keep transformers' own layer class; sliding and
chunked layers are held as transformers' ``StaticSlidingWindowLayer`` holds them (exact, bounded by the window: the
pages of a packed window ring that a graph can replay are not built yet), and ``memory_report()["layers"]`` says
which layers are packed; a layer type kvcx cannot pack is an error naming it, or kept with ``unsupported="keep"``.

What it does not do (an error says so): rows of different lengths (left padding: use KvcxCache), codecs the
Triton kernels do not run (4-bit ``kvcx.int`` only), models whose attention is not ``"kvcx"``, ``crop()``.
A step past ``max_cache_len`` from Python raises before it runs; inside a replayed graph it cannot raise: it is
flagged on the device (its writes kept within the buffers) and the next read from Python (``tokens``, a prompt,
``check()``, ``memory_report()``) raises; so do non-finite keys or values a replayed step packed (``check()``).
``get_seq_length()`` is the device counter (a tensor, as transformers' StaticCache gives): the model adds it to its
positions on the device, so a captured step reads it at every replay.
"""
from __future__ import annotations

import math
from typing import List, Optional

import torch
import transformers
from transformers.cache_utils import Cache, CacheLayerMixin

from kvcx.cache.attention_fn import ATTN_IMPLEMENTATION, HANDOFF
from kvcx.cache.device_store import attend_in_dtype
from kvcx.cache.kvcx_cache import layer_bytes, layer_kwargs, transformers_layer_class
from kvcx.cache.layer_types import FULL, STATE, check_unsupported, layer_specs
from kvcx.codecs import gpu, paged
from kvcx.codecs.base import Codec, Packed
from kvcx.codecs.dtypes import is_int
from kvcx.codecs.kvconfig import DEFAULT_SCHEME, KVConfig
from kvcx.deps import check_transformers
from kvcx.errors import KvcxError

check_transformers(transformers.__version__)


class StepPlan:
    """Where a step's tokens go, shared by a cache's layers: the tokens held (a device counter, the truth), the
    residual slot and page of a decode step's token, the packed tokens and residual tokens each row reads; advanced
    on the device at the step's first layer. ``host_len``: the tokens held when Python last read the counter;
    ``pending``: decode steps run from Python since (not those replayed from a graph: Python does not see them)."""

    def __init__(self, batch: int, t0: int, page: int, pages: int, max_len: int, device):
        self.t0, self.page_tokens, self.pages, self.max_len = t0, page, pages, max_len
        self.pos = torch.zeros((), dtype=torch.int64, device=device)
        self.where = torch.zeros(2, dtype=torch.int64, device=device)   # a decode step's slot and page
        self.slot, self.page = self.where[:1], self.where[1:]
        self.packed = torch.zeros(batch, dtype=torch.int32, device=device)
        self.live = torch.zeros(batch, dtype=torch.int32, device=device)
        self.overflow = torch.zeros((), dtype=torch.bool, device=device)
        self.host_len = 0
        self.pending = 0
        self.start = 0   # a prompt step's first token (Python's)

    def advance(self) -> None:
        """A decode step of one token a row, on the device only: its slot and page from the counter (the page
        clamped to the last one; a step past the capacity flagged), then the counter advanced. Run from Python
        (not captured), a step past the capacity raises first."""
        capturing = self.pos.is_cuda and torch.cuda.is_current_stream_capturing()
        if not capturing:
            if self.host_len + self.pending >= self.max_len:
                raise KvcxError(f"StaticKvcxCache holds max_cache_len={self.max_len} tokens: a step of one more "
                                "does not fit; build the cache with a larger max_cache_len")
            self.pending += 1
        rel = (self.pos - self.t0).view(1)
        self.slot.copy_(rel.remainder(self.page_tokens))
        self.page.copy_(rel.div(self.page_tokens, rounding_mode="floor").clamp(max=self.pages - 1))
        self.packed.copy_((self.page * self.page_tokens).expand_as(self.packed))
        self.live.copy_((self.slot + 1).expand_as(self.live))
        self.overflow.logical_or_(self.pos >= self.max_len)
        self.pos.add_(1)

    def reset(self) -> None:
        """No token held (the buffers are kept: what they hold is not read)."""
        for t in (self.pos, self.overflow):
            t.zero_()
        self.host_len = self.pending = self.start = 0

    @property
    def python_len(self) -> int:
        """The tokens held as Python knows them without reading the device (fewer after graph replays)."""
        return self.host_len + self.pending

    def sync(self, what: str) -> int:
        """The tokens held, read from the device (one host sync, from Python only); a KvcxError if a replayed step
        ran past the capacity."""
        held, over = (int(v) for v in torch.stack([self.pos, self.overflow.to(torch.int64)]).tolist())
        if over:
            raise KvcxError(f"StaticKvcxCache ({what}): a decode step ran past max_cache_len={self.max_len} (inside "
                            "a replayed graph, where it could not raise); what it wrote overwrote the last page: "
                            "build the cache with a larger max_cache_len and generate again")
        self.host_len, self.pending = held, 0
        return held

    def begin_prompt(self, tokens: int) -> int:
        """A step from Python of ``tokens`` tokens a row: the tokens held before it; the counter set after it."""
        held = self.sync("a prompt step")
        if held + tokens > self.max_len:
            raise KvcxError(f"StaticKvcxCache holds {held} tokens and max_cache_len={self.max_len}: a step of "
                            f"{tokens} more does not fit; build the cache with a larger max_cache_len")
        self.start = held
        self.pos.fill_(held + tokens)
        self.host_len = held + tokens
        return held


class StaticKvcxLayer(CacheLayerMixin):
    """One layer of a :class:`StaticKvcxCache`: its buffers, allocated at its first step for the capacity."""

    is_compileable = False   # its steps are captured as CUDA graphs of Triton launches, not traced by dynamo
    is_sliding = False

    def __init__(self, key_codec: Codec, value_codec: Codec, plan_holder: "_PlanHolder", residual_length: int,
                 max_cache_len: int, layer_idx: int):
        super().__init__()
        self.t0 = key_codec.sinks
        # pages hold packed tokens only: the codecs without sinks, on the Triton backend
        self._codecs = tuple(c.replace(sinks=0).with_backend("triton") for c in (key_codec, value_codec))
        self._plan = plan_holder
        self.residual_length, self.max_cache_len, self.layer_idx = residual_length, max_cache_len, layer_idx
        self.steps = {"device": 0, "prompt": 0}

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        B, H, _, D = key_states.shape
        if not gpu.TritonIntBackend.available() or key_states.device.type != "cuda" and not gpu.interpreting():
            raise KvcxError(f"StaticKvcxCache runs the Triton kernels: it needs triton (pip install 'kvcx[gpu]') and "
                            f"a CUDA model, not one on {key_states.device.type} (Triton's interpreter, "
                            "TRITON_INTERPRET=1, runs them on the CPU for tests); on the CPU use KvcxCache")
        self.dtype, self.device = key_states.dtype, key_states.device
        self.batch_size, self.num_heads, self.head_dim = B, H, D
        P = self.residual_length
        capacity = self._plan.capacity(self.max_cache_len, self.t0)
        kc, vc = self._codecs
        # one page a batch row, as long as the capacity: the contiguous store read by the paged kernel
        self.pool = paged.allocate(kc, vc, B, H, D, capacity, self.device)
        self.table = torch.arange(B, dtype=torch.int32, device=self.device)[:, None]
        self.res_k, self.res_v = (torch.zeros(B, H, P, D, dtype=self.dtype, device=self.device) for _ in "kv")
        self.sink_k, self.sink_v = (torch.zeros(B, H, self.t0, D, dtype=self.dtype, device=self.device)
                                    for _ in "kv") if self.t0 else (None, None)
        self.flag = torch.zeros(2, dtype=torch.int32, device=self.device)
        self.keys = self.values = None   # nothing of the context is held in the model's dtype but the residual
        self.is_initialized = True

    # -- the rows of the packed store, as [B, H, pages, a page's bytes or parameters] ------------------------

    def _bufs(self, kind: int) -> tuple:
        """The pool's (codes, scales, zero points or None) of the keys (0) or values (1)."""
        p = self.pool
        return (p.key_codes, p.key_scales, p.key_zeros) if kind == 0 else (p.value_codes, p.value_scales,
                                                                            p.value_zeros)

    def _rows(self, kind: int) -> list:
        """:meth:`_bufs` as [B, H, pages, per page] views."""
        n = self.pool.page_tokens // self.residual_length
        return [None if t is None else t.view(self.batch_size, self.num_heads, n, -1) for t in self._bufs(kind)]

    def _write_pages(self, kind: int, bufs: tuple, first: int, count: int) -> None:
        """Encoded pages ``bufs`` (codes, scales, zero points of [B, H, count pages]) into the rows from page
        ``first`` (a prompt's; a decode step's page is encoded in place)."""
        B, H = self.batch_size, self.num_heads
        for dst, src in zip(self._rows(kind), bufs):
            if dst is not None:
                dst[:, :, first:first + count] = src.reshape(B, H, count, -1)

    def _packed_record(self, kind: int, tokens: int) -> Packed:
        """The first ``tokens`` packed tokens (whole pages) of the keys (0) or values (1) as a record (copies)."""
        codec = self._codecs[kind]
        B, H, D, P = self.batch_size, self.num_heads, self.head_dim, self.residual_length
        lay = codec.layout((B, H, tokens, D), "history")
        codes, scales, zeros = (None if t is None else t[:, :, :tokens // P].contiguous() for t in self._rows(kind))
        return Packed(codes=codes.view(-1), scales=scales.view(lay.scale_shape),
                      zeros=None if zeros is None else zeros.view(lay.scale_shape), sinks=None,
                      shape=(B, H, tokens, D), dtype=gpu.dtype_name_of(self.res_k), config=codec.get_config(),
                      meta={"partial_group": 0})

    # -- steps ------------------------------------------------------------------------------------------------

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, cache_kwargs=None, device_step=False):
        """A step's keys and values [B, Hkv, S, D]: a decode step (``device_step``, the plan advanced on the device)
        writes and hands the layer to the ``"kvcx"`` attention; a prompt step packs its whole pages and returns
        the context's keys and values for SDPA."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if tuple(key_states.shape[:2]) != (self.batch_size, self.num_heads) or key_states.shape[-1] != self.head_dim \
                or key_states.shape != value_states.shape:
            raise KvcxError(f"StaticKvcxCache layer {self.layer_idx}: keys {list(key_states.shape)} and values "
                            f"{list(value_states.shape)} do not fit its buffers ([{self.batch_size}, "
                            f"{self.num_heads}, *, {self.head_dim}]); build a new cache for another batch")
        if device_step:
            return self._decode(key_states, value_states)
        return self._prompt(key_states, value_states)

    def _decode(self, key_states, value_states):
        """One launch a kind: the token written into the residual's slot and, when that fills it, the residual
        encoded into its page of the rows (:func:`kvcx.codecs.paged.encode_step`)."""
        plan = self._plan.plan
        for kind, (res, new) in enumerate(((self.res_k, key_states), (self.res_v, value_states))):
            paged.encode_step(self._codecs[kind], res, *self._bufs(kind), self.flag, new.to(self.dtype).contiguous(),
                              plan.where)
        self.steps["device"] += 1
        HANDOFF.post(key_states, self)
        return key_states, value_states

    def _prompt(self, key_states, value_states):
        plan = self._plan.plan
        L, S, t0, P = plan.start, key_states.shape[-2], self.t0, self.residual_length
        start = max(L, t0) - t0                # the packed index of the step's first token after the sinks
        page, r = divmod(start, P)             # the page being filled, its tokens in the residual
        history = None
        if L:   # the context before the step, as attention reads it: the sinks, the decoded pages, the residual
            history = []
            for kind, (sink, res) in enumerate(((self.sink_k, self.res_k), (self.sink_v, self.res_v))):
                parts = [sink[:, :, :min(L, t0)]] if t0 else []
                if page:
                    parts.append(self._codecs[kind].decode(self._packed_record(kind, page * P)))
                parts.append(res[:, :, :r])
                history.append(torch.cat(parts, dim=2))
        n_sink = min(max(t0 - L, 0), S)
        if n_sink:
            self.sink_k[:, :, L:L + n_sink] = key_states[:, :, :n_sink]
            self.sink_v[:, :, L:L + n_sink] = value_states[:, :, :n_sink]
        for kind, (codec, res, new) in enumerate(zip(self._codecs, (self.res_k, self.res_v),
                                                     (key_states, value_states))):
            rest = new[:, :, n_sink:].to(self.dtype)
            buf = torch.cat([res[:, :, :r], rest], dim=2) if r else rest
            whole = buf.shape[2] // P
            if whole:
                rec = codec.encode(buf[:, :, :whole * P].contiguous(), name=("key", "value")[kind])
                self._write_pages(kind, (rec.codes, rec.scales, rec.zeros), page, whole)
            left = buf.shape[2] - whole * P
            if left:
                res[:, :, :left] = buf[:, :, whole * P:]
        self.steps["prompt"] += 1
        if history is None:
            return key_states, value_states
        return (torch.cat([history[0], key_states.to(self.dtype)], dim=2),
                torch.cat([history[1], value_states.to(self.dtype)], dim=2))

    def attend(self, query: torch.Tensor, attention_mask: Optional[torch.Tensor], scaling: float, *,
               softcap: Optional[float] = None, sinks: Optional[torch.Tensor] = None,
               sliding_window: Optional[int] = None) -> torch.Tensor:
        """A decode step's attention ([B, Hq, 1, D] queries) over the packed pages, the sinks and the residual's
        filled slots (:class:`~kvcx.cache.attention_fn.FusedStep`; softcapping and per-head sinks in the kernels):
        [B, 1, Hq, D] in the query's dtype, as transformers' attention functions return."""
        if sliding_window:
            raise KvcxError(f"StaticKvcxCache layer {self.layer_idx}: the model attends over a sliding window of "
                            f"{sliding_window} tokens, the config's layer_types say full attention: build the cache "
                            "from the model's own config (model.config)")
        if attention_mask is not None:
            raise KvcxError("StaticKvcxCache decodes rows of equal length: this step has an attention mask (left "
                            "padding, or a mask the model builds for another reason); use KvcxCache for padded "
                            "batches")
        B, Hq, Q, D = query.shape
        plan = self._plan.plan
        exact = (self.sink_k, self.sink_v) if self.t0 else (None, None)
        logits = None if sinks is None else sinks.detach().float().reshape(-1).contiguous()
        return attend_in_dtype(query, lambda o: paged.attend(query.reshape(B, Hq, D), self.pool, self.table,
                                                             plan.packed, scaling, sinks=exact,
                                                             residual=(self.res_k, self.res_v),
                                                             residual_lens=plan.live, out=o, sink_logits=logits,
                                                             softcap=float(softcap or 0.0)))

    def materialised_step(self):
        raise KvcxError("StaticKvcxCache runs decode steps through the fused kernel only, and this model's attention "
                        "asks for what it does not do (position biases or dropout): use KvcxCache")

    def after_materialised(self) -> None:
        """Nothing: a static layer has no materialised steps (:meth:`materialised_step` raises)."""

    # -- transformers' questions ------------------------------------------------------------------------------

    def get_mask_sizes(self, query_length: int) -> tuple:
        plan = self._plan.plan
        if plan is None:
            return query_length, 0
        # a decode step's mask is not read (rows of equal length: none is built); a prompt's covers the context
        held = plan.python_len if query_length == 1 else plan.sync("its attention mask")
        return held + query_length, 0

    def get_seq_length(self):
        """The tokens held: the device counter (a 0-dim tensor, as transformers' StaticLayer returns: the model
        adds it to its positions on the device, so a captured step reads it at every replay), 0 before the first
        step."""
        plan = self._plan.plan
        return 0 if plan is None else plan.pos

    def get_max_length(self) -> int:
        return self.max_cache_len

    def get_max_cache_shape(self) -> int:
        return self.max_cache_len

    def reset(self) -> None:
        if self.is_initialized:
            for t in (self.res_k, self.res_v, self.flag):
                t.zero_()

    def reorder_cache(self, beam_idx) -> None:
        raise KvcxError("StaticKvcxCache does not reorder rows (beam search); use KvcxCache")

    def crop(self, max_length: int) -> None:
        raise KvcxError("StaticKvcxCache cannot drop tokens (crop: assisted decoding); use KvcxCache")

    def packed_bytes(self) -> int:
        return self.pool.nbytes if self.is_initialized else 0

    def exact_bytes(self) -> int:
        if not self.is_initialized:
            return 0
        held = [self.res_k, self.res_v] + ([self.sink_k, self.sink_v] if self.t0 else [])
        return int(sum(t.numel() * t.element_size() for t in held))

    def scratch_bytes(self) -> int:
        """Nothing beside the rows, the sinks and the residual: a decode step encodes into its page in place."""
        return 0


class _PlanHolder:
    """The cache's step plan, made at its first step (the batch and device are known then) and shared by its
    layers; the cache is the only one to advance it."""

    def __init__(self, page: int):
        self.page = page
        self.plan: Optional[StepPlan] = None

    def start(self, batch: int, t0: int, max_cache_len: int, device) -> StepPlan:
        """The plan, made at the first step for its batch and device."""
        pages = self.capacity(max_cache_len, t0) // self.page
        self.plan = StepPlan(batch, t0, self.page, pages, max_cache_len, device)
        return self.plan

    def capacity(self, max_cache_len: int, t0: int) -> int:
        """Packed tokens a row holds: ``max_cache_len`` after the sinks, to whole pages of the kernel's tiles."""
        unit = self.page * gpu.ATTN_BLOCK_TOKENS // math.gcd(self.page, gpu.ATTN_BLOCK_TOKENS)
        return max(unit, -(-(max_cache_len - t0) // unit) * unit)


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
    """

    def __init__(self, config, max_cache_len: int, group_size: Optional[int] = None, scheme: str = DEFAULT_SCHEME,
                 residual_length: int = 64, bits: Optional[int] = None, sinks: Optional[int] = None,
                 rotate: Optional[bool] = None, kv_config: Optional[KVConfig] = None, unsupported: str = "error"):
        if isinstance(max_cache_len, bool) or not is_int(max_cache_len) or max_cache_len < 1:
            raise KvcxError(f"max_cache_len must be a positive integer, got {max_cache_len!r}")
        if isinstance(residual_length, bool) or not is_int(residual_length) or residual_length < 16 or \
                residual_length & (residual_length - 1):
            raise KvcxError(f"residual_length must be a power of two from 16 (a page of the packed rows), got "
                            f"{residual_length!r}")
        kv = kv_config or KVConfig.from_scheme(scheme, group_size=group_size, bits=bits, sinks=sinks, rotate=rotate)
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        specs = layer_specs(config)
        check_unsupported(specs, unsupported, "StaticKvcxCache")
        latent = [s.index for s in specs if s.latent]
        if latent:
            raise KvcxError(f"StaticKvcxCache layer {latent[0]}: MLA (the model expands the cached latent after the "
                            "cache) has no decode step the Triton kernels can replay; use KvcxCache")
        full = [s.index for s in specs if s.kind == FULL]
        if not full:
            raise KvcxError("StaticKvcxCache packs full-attention layers and this model has none; use KvcxCache")
        codecs = {i: (kv.for_layer(i).key, kv.for_layer(i).value) for i in full}
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
        t0 = {kc.sinks for kc, _ in codecs.values()}
        if len(t0) > 1 or max_cache_len <= max(t0):
            raise KvcxError(f"StaticKvcxCache: every layer must keep the same sink tokens, fewer than max_cache_len "
                            f"({max_cache_len}); got {sorted(t0)}")
        self.kv_config = kv
        self.residual_length = residual_length
        self._config = text
        self._holder = _PlanHolder(residual_length)
        self._t0 = t0.pop()
        self._max_len = max_cache_len
        self._device_step = False   # the current step's kind (decided at its first packed layer)
        self._first = full[0]
        self.specs = specs
        super().__init__(layers=[StaticKvcxLayer(*codecs[s.index], self._holder, residual_length, max_cache_len,
                                                 s.index) if s.kind == FULL else self._kept(s, max_cache_len)
                                 for s in specs])

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
        """The layers kvcx packs (the full-attention ones)."""
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
        scratch = sum(layer.scratch_bytes() for layer in layers)
        static = sum(2 * 2 * layer.batch_size * layer.num_heads * self._max_len * layer.head_dim
                     for layer in layers)
        steps = {k: sum(layer.steps[k] for layer in self.packed_layers) for k in ("device", "prompt")}
        kept = sum(layer_bytes(layer) for layer in self.layers if not isinstance(layer, StaticKvcxLayer))
        return {"packed_bytes": packed, "residual_bytes": exact, "scratch_bytes": scratch, "kept_bytes": kept,
                "total_bytes": packed + exact + scratch + kept, "tokens": self.check(), "max_cache_len":
                self._max_len, "bf16_static_bytes": static, "attention_steps": steps, "backend": "triton",
                "layers": [{"index": s.index, "type": s.type, "kvcx": "packed" if s.kind == FULL else "kept",
                            "window": s.window} for s in self.specs]}
