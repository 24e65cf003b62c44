"""The layers of :class:`~kvcx.cache.static_cache.StaticKvcxCache` and the step plan they share (that module's
docstring says what a step does).

- :class:`StaticKvcxLayer`: a full-attention layer, every token packed into one row a batch row as long as the
  capacity;
- :class:`StaticKvcxWindowLayer`: a sliding-window or chunked layer, its window packed into a ring of pages (the
  residual's size each) that a decode step overwrites in turn; the window's first token is a mask the plan builds
  on the device (:class:`WindowRing`), so a step reads nothing from the host and replays from a CUDA graph;
- :class:`StepPlan`: where a step's tokens go, advanced on the device once a step for every layer.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from transformers.cache_utils import CacheLayerMixin

from kvcx.cache.attention_fn import HANDOFF
from kvcx.cache.device_store import attend_in_dtype
from kvcx.cache.layer_types import CHUNKED
from kvcx.codecs import gpu, paged, gpu_attn
from kvcx.codecs.base import Codec, Packed
from kvcx.errors import KvcxError


def capturing(t: torch.Tensor) -> bool:
    """Whether a step on ``t``'s device is being captured in a CUDA graph (nothing may be read back to the host)."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


class StepPlan:
    """Where a step's tokens go, shared by a cache's layers: the tokens held (a device counter, the truth), the
    residual slot and page of a decode step's token, the packed tokens and residual tokens each row reads; advanced
    on the device at the step's first layer. ``host_len``: the tokens held when Python last read the counter;
    ``pending``: decode steps run from Python since (not those replayed from a graph: Python does not see them)."""

    def __init__(self, batch: int, t0: int, page: int, pages: int, max_len: int, device, rings=()):
        self.t0, self.page_tokens, self.pages, self.max_len = t0, page, pages, max_len
        # the windowed layers' rings, one a (window, chunked, pages) the layers share
        self.rings = {spec: WindowRing(*spec, page, batch, device) for spec in rings}
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
        if not capturing(self.pos):
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
        for ring in self.rings.values():
            ring.advance(self.pos)
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
    widths_may_differ = False   # keys and values of one width: the paged kernel reads them so (MLA's layer: True)

    def __init__(self, key_codec: Codec, value_codec: Codec, plan_holder: "PlanHolder", residual_length: int,
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
        Dv = value_states.shape[-1]
        if not gpu.TritonIntBackend.available() or key_states.device.type != "cuda" and not gpu_attn.interpreting():
            raise KvcxError(f"StaticKvcxCache runs the Triton kernels: it needs triton (pip install 'kvcx[gpu]') and "
                            f"a CUDA model, not one on {key_states.device.type} (Triton's interpreter, "
                            "TRITON_INTERPRET=1, runs them on the CPU for tests); on the CPU use KvcxCache")
        if Dv != D and not self.widths_may_differ:
            raise KvcxError(f"StaticKvcxCache layer {self.layer_idx}: keys of {D} channels and values of {Dv}; its "
                            "decode kernel reads keys and values of one width: use KvcxCache")
        self.dtype, self.device = key_states.dtype, key_states.device
        self.batch_size, self.num_heads, self.head_dim, self.value_dim = B, H, D, Dv
        P = self.residual_length
        capacity = self._capacity()
        kc, vc = self._codecs
        # one page a batch row, as long as the capacity: the contiguous store read by the paged kernel
        self.pool = paged.allocate(kc, vc, B, H, D, capacity, self.device, value_dim=Dv)
        self.table = torch.arange(B, dtype=torch.int32, device=self.device)[:, None]
        self.res_k, self.res_v = (torch.zeros(B, H, P, d, dtype=self.dtype, device=self.device) for d in (D, Dv))
        self.sink_k, self.sink_v = (torch.zeros(B, H, self.t0, d, dtype=self.dtype, device=self.device)
                                    for d in (D, Dv)) if self.t0 else (None, None)
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

    def _capacity(self) -> int:
        """Packed tokens a row holds: ``max_cache_len`` after the sinks, to whole tiles."""
        return self._plan.capacity(self.max_cache_len, self.t0)

    def _write_pages(self, kind: int, bufs: tuple, parts: list) -> None:
        """Encoded pages ``bufs`` (codes, scales, zero points of [B, H, len(parts) pages]) into the rows' pages
        ``parts`` (a prompt's; a decode step's page is encoded in place)."""
        B, H = self.batch_size, self.num_heads
        at = torch.tensor(parts, dtype=torch.int64, device=self.device)
        for dst, src in zip(self._rows(kind), bufs):
            if dst is not None:
                dst[:, :, at] = src.reshape(B, H, len(parts), -1)

    def _packed_record(self, kind: int, parts: list) -> Packed:
        """The packed tokens of the rows' pages ``parts`` (whole pages, in that order) of the keys (0) or values (1)
        as a record (copies)."""
        codec = self._codecs[kind]
        B, H, P = self.batch_size, self.num_heads, self.residual_length
        D = (self.head_dim, self.value_dim)[kind]
        tokens = len(parts) * P
        lay = codec.layout((B, H, tokens, D), "history")
        at = torch.tensor(parts, dtype=torch.int64, device=self.device)
        codes, scales, zeros = (None if t is None else t.index_select(2, at).contiguous() for t in self._rows(kind))
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
                or key_states.shape[:-1] != value_states.shape[:-1] or value_states.shape[-1] != self.value_dim:
            raise KvcxError(f"StaticKvcxCache layer {self.layer_idx}: keys {list(key_states.shape)} and values "
                            f"{list(value_states.shape)} do not fit its buffers ([{self.batch_size}, "
                            f"{self.num_heads}, *, {self.head_dim}] and [..., {self.value_dim}]); build a new cache "
                            "for another batch")
        if device_step:
            return self._decode(key_states, value_states)
        return self._prompt(key_states, value_states)

    def _decode(self, key_states, value_states):
        """One launch a kind: the token written into the residual's slot and, when that fills it, the residual
        encoded into its page of the rows (:func:`kvcx.codecs.paged.encode_step`); the layer posted for the
        attention."""
        self._encode_step(key_states, value_states)
        HANDOFF.post(key_states, self)
        return key_states, value_states

    def _encode_step(self, key_states, value_states) -> None:
        where = self._step()[0]
        for kind, (res, new) in enumerate(((self.res_k, key_states), (self.res_v, value_states))):
            paged.encode_step(self._codecs[kind], res, *self._bufs(kind), self.flag, new.to(self.dtype).contiguous(),
                              where)
        self.steps["device"] += 1

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
                    parts.append(self._codecs[kind].decode(self._packed_record(kind, list(range(page)))))
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
                self._write_pages(kind, (rec.codes, rec.scales, rec.zeros), list(range(page, page + whole)))
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
        return self._fused(query, attention_mask, scaling, softcap, sinks)

    def _step(self) -> tuple:
        """A decode step's (slot and page, packed tokens a row reads, residual tokens a row reads, mask or None),
        on the device: the plan's."""
        plan = self._plan.plan
        return plan.where, plan.packed, plan.live, None

    def _fused(self, query, attention_mask, scaling, softcap, sinks) -> torch.Tensor:
        """The decode step's attention through :func:`kvcx.codecs.paged.attend`, as :meth:`attend` says. A mask
        given while the step is being captured in a CUDA graph is not read: transformers before 5.19 builds SDPA's
        mask whenever it traces (it cannot look at the padding then), and a padded batch's mask is refused by the
        steps from Python before any capture (the warm-up's)."""
        if attention_mask is not None and not capturing(query):
            raise KvcxError("StaticKvcxCache decodes rows of equal length: this step has an attention mask (left "
                            "padding, or a mask the model builds for another reason); use KvcxCache for padded "
                            "batches")
        B, Hq, Q, D = query.shape
        _, packed, live, mask = self._step()
        exact = (self.sink_k, self.sink_v) if self.t0 else (None, None)
        logits = None if sinks is None else sinks.detach().float().reshape(-1).contiguous()
        return attend_in_dtype(query, lambda o: paged.attend(query.reshape(B, Hq, D), self.pool, self.table,
                                                             packed, scaling, sinks=exact,
                                                             residual=(self.res_k, self.res_v), residual_lens=live,
                                                             out=o, sink_logits=logits,
                                                             softcap=float(softcap or 0.0), mask=mask,
                                                             launch=self._plan.launch))

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


class StaticKvcxWindowLayer(StaticKvcxLayer):
    """One sliding-window or chunked layer of a :class:`~kvcx.cache.static_cache.StaticKvcxCache`: the window
    packed into a ring of pages (:class:`WindowRing`: a page the residual's size, enough pages for the window),
    the residual exact, no sinks (a window leaves them behind). A decode step is the full layer's four launches
    (the ring's page in place of the row's next page; the window's first token a mask the plan computes on the
    device); a prompt decodes the window's pages. It answers transformers' questions as ``StaticSlidingWindowLayer``
    does (``get_mask_sizes`` covers the last ``window - 1`` tokens and the step's), but for a decode step, whose
    sizes stay under the window so that transformers builds no mask for rows of equal length (the ring's is
    used). It holds the ring's pages and the residual at any length (a ring of ``window`` tokens, rounded up to
    the kernel's tiles)."""

    is_sliding = True

    def __init__(self, key_codec: Codec, value_codec: Codec, plan_holder: "PlanHolder", residual_length: int,
                 max_cache_len: int, spec):
        super().__init__(key_codec.replace(sinks=0), value_codec.replace(sinks=0), plan_holder, residual_length,
                         max_cache_len, spec.index)
        self.spec, self.window, self.chunked = spec, spec.window, spec.kind == CHUNKED
        self.ring = plan_holder.ring(self.window, self.chunked)

    def _capacity(self) -> int:
        return self.ring[2] * self.residual_length

    def _step(self) -> tuple:
        ring = self._plan.plan.rings[self.ring]
        return ring.where, ring.lens, ring.live, ring.mask

    def attend(self, query: torch.Tensor, attention_mask: Optional[torch.Tensor], scaling: float, *,
               softcap: Optional[float] = None, sinks: Optional[torch.Tensor] = None,
               sliding_window: Optional[int] = None) -> torch.Tensor:
        """A decode step's attention over the window: the ring's pages (the mask keeps the window's tokens) and
        the residual's filled slots, as :meth:`StaticKvcxLayer.attend`."""
        if sliding_window and not self.chunked and int(sliding_window) != self.window:
            raise KvcxError(f"StaticKvcxCache {self.spec.describe()}: the model attends over a window of "
                            f"{sliding_window} tokens: build the cache from the model's own config (model.config)")
        return self._fused(query, attention_mask, scaling, softcap, sinks)

    def _prompt(self, key_states, value_states):
        """A step from Python: the window's tokens before it (from the first one the step's mask covers: its
        pages decoded, the residual), then the step's whole pages encoded into the ring (only the last ring's
        worth: earlier ones would be overwritten) and the rest into the residual."""
        plan = self._plan.plan
        L, P, n = plan.start, self.residual_length, self.ring[2]
        c, r = divmod(L, P)
        first = max(L - self.window + 1, 0)
        history = None
        if L:
            lo = first // P   # its pages are in the ring: pages x P >= window (WindowRing)
            history = []
            for kind, res in enumerate((self.res_k, self.res_v)):
                parts = []
                if lo < c:
                    dec = self._codecs[kind].decode(self._packed_record(kind, [g % n for g in range(lo, c)]))
                    parts.append(dec[:, :, first - lo * P:])
                parts.append(res[:, :, max(first - c * P, 0):r])
                history.append(torch.cat(parts, dim=2))
        for kind, (codec, res, new) in enumerate(zip(self._codecs, (self.res_k, self.res_v),
                                                     (key_states, value_states))):
            rest = new.to(self.dtype)
            buf = torch.cat([res[:, :, :r], rest], dim=2) if r else rest
            whole = buf.shape[2] // P
            keep = min(whole, n)
            if keep:
                rec = codec.encode(buf[:, :, (whole - keep) * P:whole * P].contiguous(), name=("key", "value")[kind])
                self._write_pages(kind, (rec.codes, rec.scales, rec.zeros),
                                  [(c + j) % n for j in range(whole - keep, whole)])
            left = buf.shape[2] - whole * P
            if left:
                res[:, :, :left] = buf[:, :, whole * P:]
        self.steps["prompt"] += 1
        if history is None:
            return key_states, value_states
        return (torch.cat([history[0], key_states.to(self.dtype)], dim=2),
                torch.cat([history[1], value_states.to(self.dtype)], dim=2))

    def get_mask_sizes(self, query_length: int) -> tuple:
        plan = self._plan.plan
        if plan is None:
            return query_length, 0
        if query_length == 1:   # under the window: no mask is built for rows of equal length (the ring's is read)
            return min(plan.python_len + 1, self.window - 1), 0
        held = plan.sync("its attention mask")
        return min(held, self.window - 1) + query_length, max(held - self.window + 1, 0)

    def get_max_length(self) -> int:
        return self.window

    def get_max_cache_shape(self) -> int:
        return min(self.window, self.max_cache_len)


class PlanHolder:
    """The cache's step plan, made at its first step (the batch and device are known then) and shared by its
    layers; the cache is the only one to advance it. Windowed layers register their ring at construction."""

    def __init__(self, page: int, launch=None):
        self.page = page
        self.launch = launch   # the cache's LaunchSettings (None: the defaults), for every layer's steps
        self.plan: Optional[StepPlan] = None
        self.rings = set()

    def ring(self, window: int, chunked: bool) -> tuple:
        """A windowed layer's ring, registered: (window, chunked, pages), pages enough that a step never reads a
        page it overwrites (:class:`WindowRing`), to whole tiles of the kernel."""
        spec = (window, chunked, self.capacity(window, 0) // self.page)
        self.rings.add(spec)
        return spec

    def start(self, batch: int, t0: int, max_cache_len: int, device) -> StepPlan:
        """The plan, made at the first step for its batch and device."""
        pages = self.capacity(max_cache_len, t0) // self.page
        self.plan = StepPlan(batch, t0, self.page, pages, max_cache_len, device, sorted(self.rings))
        return self.plan

    def capacity(self, max_cache_len: int, t0: int) -> int:
        """Packed tokens a row holds: ``max_cache_len`` after the sinks, to whole pages of the kernel's tiles."""
        unit = self.page * gpu_attn.TILE_TOKENS // math.gcd(self.page, gpu_attn.TILE_TOKENS)
        return max(unit, -(-(max_cache_len - t0) // unit) * unit)


class WindowRing:
    """A windowed layer's decode step, computed on the device at the step's first layer (shared by the layers of
    one window): a sliding (``chunked`` False) or chunked window of ``window`` tokens over a ring of ``pages``
    pages of P tokens and a residual of P, absolute positions (a windowed layer keeps no sinks).

    The token at position p goes to the residual's slot p mod P; page c = p // P is the one being filled, and when
    the step fills it (slot P - 1) it is encoded into ring page c mod pages, over page c - pages. The step attends
    to the residual's slots up to p's and to the ring's pages in table order, of which the mask keeps the tokens
    of pages before c from the window's first token on: ring page s holds page g = c - 1 - ((c - 1 - s) mod pages)
    (none where g < 0), its token k position g P + k. With pages x P >= window, a page is overwritten only once
    every token of it is before the window (at slot P - 1 the window starts at (c + 1) P - window), so what the mask
    keeps is there, and what it drops may be anything (the page being overwritten at that step). The residual's
    tokens are all in the window: a window of at least P tokens (sliding), or chunks of whole pages (chunked)."""

    def __init__(self, window: int, chunked: bool, pages: int, page: int, batch: int, device):
        self.window, self.chunked, self.pages, self.page_tokens = window, chunked, pages, page
        self.where = torch.zeros(2, dtype=torch.int64, device=device)     # the step's slot and ring page
        self.live = torch.zeros(batch, dtype=torch.int32, device=device)  # residual tokens a row reads
        self.lens = torch.zeros(batch, dtype=torch.int32, device=device)  # ring tokens a row reads (table order)
        at = torch.arange(pages * page, device=device)
        self.ring_page, self.offset = at // page, at % page
        self.row = torch.zeros(pages * page, dtype=torch.float32, device=device)
        self.mask = self.row.expand(batch, -1)                           # every row's: rows of equal length

    def advance(self, pos: torch.Tensor) -> None:
        """The step of the token at position ``pos`` (a 0-dim int64 tensor on the device): its slot and page, the
        lengths and the mask (device operations only: a graph replays them)."""
        P, n = self.page_tokens, self.pages
        c = pos.div(P, rounding_mode="floor")
        slot = pos - c * P
        self.where[0].copy_(slot)
        self.where[1].copy_(c.remainder(n))
        self.live.copy_((slot + 1).expand_as(self.live))
        self.lens.copy_((c.clamp(max=n) * P).expand_as(self.lens))
        first = pos.div(self.window, rounding_mode="floor") * self.window if self.chunked else pos - self.window + 1
        g = c - 1 - (c - 1 - self.ring_page).remainder(n)
        keep = (g >= 0) & (g * P + self.offset >= first)
        self.row.copy_(torch.where(keep, 0.0, float("-inf")))
