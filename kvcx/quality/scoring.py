"""Scoring a model with an exact and a compressed KV cache on the same tokens: the core of ``kvcx validate``
and ``kvcx calibrate``.

Sliding windows over a text (:func:`window_starts`); in each window the context's exact cache is built
once and scored once, then every round trip (tensors -> decoded tensors, packed bytes, ErrorStats)
compresses that same cache and scores the same continuation tokens (:func:`compare_prefix`). A
:class:`PerplexityRun` sums what one setting did: negative log-likelihoods, KL divergence and top-1
agreement against the exact cache's next-token distributions, bytes. torch is imported inside the
functions that need it.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Mapping, Optional

import numpy as np

from kvcx.codecs.metrics import ErrorStats
from kvcx.errors import DatasetError, KvcxError

WindowCallback = Callable[[int, int], None]
# a round trip of one cache: tensors -> (decoded tensors, packed bytes, ErrorStats)
Roundtrip = Callable[[Dict[str, np.ndarray]], tuple]


def window_starts(n_tokens: int, window: int, stride: int, max_windows: int) -> List[int]:
    """First token of each evaluation window (0 = every window of the text)."""
    if n_tokens < window:
        raise DatasetError(f"the evaluation text has {n_tokens} tokens, fewer than one window of {window}; "
                           "use a longer text or a smaller --window")
    starts = list(range(0, n_tokens - window + 1, stride))
    return starts if max_windows == 0 else starts[:max_windows]

def check_window(window: int, stride: int, max_windows: int, context_limit: int) -> None:
    if window < 2 or stride < 2:
        raise KvcxError(f"window={window} and stride={stride} must be at least 2")
    if stride >= window:
        raise KvcxError(f"stride={stride} must be smaller than window={window}: the window's first "
                        "window - stride tokens are the compressed context")
    if window > context_limit:
        raise KvcxError(f"window={window} exceeds the model's context of {context_limit} tokens")
    if max_windows < 0:
        raise KvcxError(f"max_windows={max_windows} must be >= 0 (0 = the whole test set)")

def identity_roundtrip(tensors):
    """No compression: the decoded cache is the exact cache (the delta must be exactly 0)."""
    from kvcx.quality.bridge import original_nbytes

    return dict(tensors), original_nbytes(tensors), ErrorStats(n=sum(a.size for a in tensors.values()))

def _log_probs(logits):
    """Log-probabilities (FP32) of [T, vocab] logits."""
    return logits.float().log_softmax(dim=-1)

def _nll(lp, targets) -> float:
    """Summed negative log-likelihood of ``targets`` [T] under log-probabilities ``lp`` (float64 sum)."""
    return float(-lp.gather(-1, targets[:, None]).double().sum())

def _kl(p, lp, lq) -> float:
    """Summed KL(p || q) over the rows, from p, its log and q's log (float64 sum)."""
    return float((p * (lp - lq)).sum(-1).clamp_min(0.0).double().sum())

def sequence_nll(logits, targets) -> float:
    """Summed negative log-likelihood of ``targets`` [T] under ``logits`` [T, vocab] (float64 sum)."""
    return _nll(_log_probs(logits), targets)

def next_token_divergence(base_logits, comp_logits) -> tuple:
    """(summed KL(exact || compressed) of the next-token distributions in nats, top-1 matches) over the
    rows of two [T, vocab] logit tensors: the sensitive measures beside perplexity (llama.cpp's KLD)."""
    lp, lq = _log_probs(base_logits), _log_probs(comp_logits)
    return _kl(lp.exp(), lp, lq), int((base_logits.argmax(-1) == comp_logits.argmax(-1)).sum())

# Long windows: the model runs in chunks of FORWARD_CHUNK tokens and returns hidden states, and the output head
# turns HEAD_SLICE rows at a time into logits, so no tensor grows with the window times the vocabulary (at a
# window of 8,192 on a 49,152-token vocabulary one FP32 logit tensor alone is 1.6 GB). Windows of up to 1,024
# tokens run as one chunk and one slice, as before.
FORWARD_CHUNK = 1024
HEAD_SLICE = 512

def forward_hidden(model, ids, cache=None, chunk: int = FORWARD_CHUNK, start: Optional[int] = None):
    """(final hidden states [T, hidden], cache) of ``ids`` [1, T] run through the model's decoder over ``cache``
    (a new DynamicCache(config=...) when None: a hybrid model's layers as its own cache builds them) in chunks of ``chunk`` tokens, as a chunked prefill does. ``start``: the first
    token's position (default: the cache's length); a cache that evicted tokens holds fewer than its context."""
    import torch

    if cache is None:
        from transformers import DynamicCache

        cache = DynamicCache(config=model.config)
    from kvcx.deps import cache_keyword, decoder_of

    decoder = decoder_of(model)
    kw = cache_keyword(decoder.forward)
    def positions(c):
        if start is None:
            return {}
        n = min(chunk, ids.shape[1] - c)
        return {"position_ids": torch.arange(start + c, start + c + n, device=ids.device)[None]}

    parts = [decoder(input_ids=ids[:, c:c + chunk], use_cache=True, **{kw: cache}, **positions(c)).last_hidden_state[0]
             for c in range(0, ids.shape[1], chunk)]
    return (parts[0] if len(parts) == 1 else torch.cat(parts)), cache

def output_logits(model, hidden):
    """The model's next-token logits for hidden states [T, hidden] (its output head, with the final soft cap of
    the models that have one)."""
    import torch

    logits = model.get_output_embeddings()(hidden)
    from kvcx.cache.layer_types import text_config

    cap = getattr(text_config(model.config), "final_logit_softcapping", None)   # Gemma 3/4's multimodal class: its text
    return torch.tanh(logits / cap) * cap if cap else logits

def exact_side(model, base_hidden, targets, slice_rows: int = HEAD_SLICE) -> Optional[tuple]:
    """What :func:`score_hidden` computes of the exact pass, once for every setting scored against it: the
    (log-probabilities, probabilities, top-1 tokens, summed NLL of ``targets``) of its rows. None when the rows
    take more than one slice of ``slice_rows``: their logits would then be held whole (a window of 8,192 scored
    tokens on a 49,152-token vocabulary: 1.6 GB), so each setting recomputes them a slice at a time."""
    if targets.numel() > slice_rows:
        return None
    logits = output_logits(model, base_hidden)
    lp = _log_probs(logits)
    return lp, lp.exp(), logits.argmax(-1), _nll(lp, targets)

def score_hidden(model, base_hidden, comp_hidden, targets, slice_rows: int = HEAD_SLICE,
                 exact: Optional[tuple] = None) -> tuple:
    """(baseline NLL, compressed NLL, (KL sum, top-1 matches)) of ``targets`` [T] predicted from the two
    [T, hidden] hidden states, ``slice_rows`` rows of logits at a time; ``exact``: :func:`exact_side` of these
    rows (the same figures, not computed again), or None. The same sums as :func:`sequence_nll` and
    :func:`next_token_divergence` over whole logit tensors."""
    base = comp = kl = 0.0
    top1 = 0
    for s in range(0, targets.numel(), slice_rows):
        t = targets[s:s + slice_rows]
        lp, p, top, nll = exact if exact is not None else exact_side(model, base_hidden[s:s + slice_rows], t,
                                                                    slice_rows)
        c = output_logits(model, comp_hidden[s:s + slice_rows])
        lq = _log_probs(c)
        base += nll
        comp += _nll(lq, t)
        kl += _kl(p, lp, lq)
        top1 += int((top == c.argmax(-1)).sum())
        del c, lq
    return base, comp, (kl, top1)

@dataclass
class PerplexityRun:
    """Summed NLLs and sizes of one compressed setting over the scored windows."""

    baseline_nll: float = 0.0
    compressed_nll: float = 0.0
    tokens: int = 0
    windows: int = 0
    original_bytes: int = 0     # the cache in the model's dtype
    packed_bytes: int = 0
    values: int = 0
    stats: ErrorStats = field(default_factory=ErrorStats)
    codec_time_s: float = 0.0   # wall time of the round trips
    codec_cpu_s: float = 0.0    # CPU time of the round trips (all threads)
    kl_sum: float = 0.0         # summed KL(exact || compressed) over the scored tokens, nats
    top1_matches: int = 0       # scored tokens whose most likely next token is the same on both caches
    records: list = field(default_factory=list, repr=False)   # each window's add_window arguments, in order

    def add_window(self, base_nll: float, comp_nll: float, tokens: int, original_bytes: int, packed_bytes: int,
                   values: int, codec_time_s: float, stats: Optional[ErrorStats] = None,
                   codec_cpu_s: float = 0.0, divergence: tuple = (0.0, 0)) -> None:
        """Add one window's scores and sizes (kept in :attr:`records`, so that a data-parallel run's rank 0 adds
        every rank's windows in order: :func:`kvcx.quality.ranks.gather_runs`)."""
        self.records.append(dict(base_nll=base_nll, comp_nll=comp_nll, tokens=tokens, original_bytes=original_bytes,
                                 packed_bytes=packed_bytes, values=values, codec_time_s=codec_time_s, stats=stats,
                                 codec_cpu_s=codec_cpu_s, divergence=divergence))
        self.kl_sum += divergence[0]
        self.top1_matches += divergence[1]
        self.baseline_nll += base_nll
        self.compressed_nll += comp_nll
        self.tokens += int(tokens)
        self.windows += 1
        self.original_bytes += original_bytes
        self.packed_bytes += packed_bytes
        self.values += values
        self.codec_time_s += codec_time_s
        self.codec_cpu_s += codec_cpu_s
        if stats is not None:
            self.stats += stats

    @property
    def baseline_ppl(self) -> float:
        return math.exp(self.baseline_nll / self.tokens)

    @property
    def compressed_ppl(self) -> float:
        return math.exp(self.compressed_nll / self.tokens)

    @property
    def mean_kld(self) -> float:
        return self.kl_sum / self.tokens if self.tokens else 0.0

    @property
    def top1_agreement(self) -> float:
        return self.top1_matches / self.tokens if self.tokens else 0.0

    @property
    def bits_per_value(self) -> float:
        return 8.0 * self.packed_bytes / self.values if self.values else 0.0

    @property
    def ratio_vs_fp16(self) -> float:
        return 2.0 * self.values / self.packed_bytes if self.packed_bytes else 0.0

def compare_prefix(model, ids, starts: List[int], window: int, stride: int, roundtrips: Mapping[str, Roundtrip],
                   on_window: Optional[WindowCallback] = None) -> Dict[str, PerplexityRun]:
    """Prefix mode for several settings at once: each window's context cache is built and scored exactly
    once, then every round trip compresses that same cache and scores the same continuation tokens. A round trip
    with a ``query_window`` (a press that reads the model's queries, :class:`~kvcx.quality.eviction.PressRoundtrip`)
    is also given the context's last queries, captured during its prefill; the continuation runs at its own
    positions whatever the round trip kept."""
    import contextlib
    import copy

    import torch

    from kvcx.quality.bridge import (
        DeviceRoundtrip,
        cache_to_device_tensors,
        cache_to_tensors,
        is_hybrid,
        original_nbytes,
        rebuilt,
        tensor_devices,
        value_count,
    )
    from kvcx.quality.eviction import attending

    dev = next(model.parameters()).device
    runs = {label: PerplexityRun() for label in roundtrips}
    ctx_len = window - stride
    query_window = max((getattr(r, "query_window", 0) for r in roundtrips.values()), default=0)
    with torch.inference_mode():
        for w, a in enumerate(starts):
            ctx = ids[a:a + ctx_len][None].to(dev)
            cont = ids[a + ctx_len:a + window][None].to(dev)
            targets = cont[0, 1:]
            if query_window:
                from kvcx.quality.eviction import QueryCapture

                capture = QueryCapture(model, query_window)
            else:
                capture = contextlib.nullcontext()
            with capture:
                _, cache = forward_hidden(model, ctx)
            queries = capture.numpy() if query_window else None
            # a hybrid model's cache (linear-attention states, sliding windows) is kept as the prefix left it, to be
            # refilled with each setting's decoded tensors
            template = copy.deepcopy(cache) if is_hybrid(cache) else None
            # device round trips read the cache where it is; the others a host copy (made once)
            on_device = cache_to_device_tensors(cache)
            devices = tensor_devices(cache)   # each layer's, where the model keeps it
            host = cache_to_tensors(cache) if not all(isinstance(r, DeviceRoundtrip) for r in roundtrips.values()) \
                else None
            base_hidden = forward_hidden(model, cont, cache)[0][:-1]
            exact = exact_side(model, base_hidden, targets)      # scored once, for every setting
            del cache
            for label, roundtrip in roundtrips.items():
                t, c = time.perf_counter(), time.process_time()
                tensors = on_device if isinstance(roundtrip, DeviceRoundtrip) else host
                decoded, nbytes, stats = (roundtrip(tensors, queries) if getattr(roundtrip, "query_window", 0)
                                          else roundtrip(tensors))
                comp_cache = rebuilt(template, decoded, devices)    # a press may leave layers uneven
                del decoded
                codec_s, codec_cpu = time.perf_counter() - t, time.process_time() - c
                with attending(model, comp_cache):
                    comp_hidden = forward_hidden(model, cont, comp_cache, start=ctx_len)[0][:-1]
                del comp_cache
                base, comp, divergence = score_hidden(model, base_hidden, comp_hidden, targets, exact=exact)
                runs[label].add_window(base, comp, targets.numel(), original_nbytes(tensors), nbytes,
                                       value_count(tensors), codec_s, stats, codec_cpu, divergence)
            if on_window:
                on_window(w + 1, len(starts))
    return runs


def greedy_reply(model, question, cache, n_tokens: int, start: int, eos: Optional[int] = None,
                 stop: Optional[Callable[[List[int]], bool]] = None) -> List[int]:
    """The greedy continuation of ``question`` [1, Q] over ``cache`` (extended), the question's first token at
    position ``start`` (the context's length, whatever the cache kept): up to ``n_tokens``, ending early at
    ``eos`` or once ``stop(tokens)`` holds (the reply already holds every answer: more tokens cannot change the
    verdict)."""
    import torch

    from kvcx.deps import cache_keyword, decoder_of

    decoder = decoder_of(model)
    kw = cache_keyword(decoder.forward)
    tokens, step, pos = [], question, start
    for _ in range(n_tokens):
        n = step.shape[1]
        positions = torch.arange(pos, pos + n, device=step.device)[None]
        hidden = decoder(input_ids=step, position_ids=positions, use_cache=True, **{kw: cache}).last_hidden_state[0]
        pos += n
        nxt = int(output_logits(model, hidden[-1:]).argmax(-1))
        tokens.append(nxt)
        if nxt == eos or (stop is not None and stop(tokens)):
            break
        step = torch.tensor([[nxt]], device=question.device)
    return tokens
