"""``kvcx validate``: perplexity with the exact vs the kvcx-compressed KV cache.

Sliding windows over WikiText-2 raw test: window ``w`` (default 1024), stride ``s``
(default 512). Window ``i`` covers tokens ``[i*s, i*s + w)``; its first ``w - s``
tokens are the context, run once to build the exact KV cache. That cache goes
through the real kvcx codec and file format (encode -> packed safetensors bytes ->
read -> decode). The window's last ``s`` tokens are then scored twice, attending
to the exact cache and to the decoded cache: token ``j`` of the continuation is
predicted from the continuation's position ``j - 1`` (``s - 1`` tokens per
window, every one of them attending to the compressed context). Windows never
overlap in scored tokens, and both perplexities come from the same tokens. On the same
tokens it also measures the mean KL divergence between the exact and the compressed
model's next-token distributions and how often their most likely next token agrees.

This module computes; it prints nothing. Progress reaches the caller through two
callbacks: ``on_phase(step, total, message)`` and ``on_window(done, total)``.
The scoring itself lives in :mod:`kvcx.quality.scoring`, model and text loading in
:mod:`kvcx.quality.models`; torch is imported inside the functions that need it.
"""
from __future__ import annotations

import contextlib
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, List, Mapping, Optional

import numpy as np

from kvcx.cache.layer_types import refuse_press, text_config
from kvcx.codecs.kvconfig import KVConfig
from kvcx.codecs.metrics import Thresholds, check_thresholds, json_safe, quality_level
from kvcx.presses import PressedSetting
from kvcx.errors import KvcxError
from kvcx.quality.bridge import DeviceRoundtrip, backend_of, model_dims, model_frame
from kvcx.quality import ranks
from kvcx.quality.models import load_dataset_text, load_model_and_tokenizer, pick_device, resolve_model
from kvcx.quality.peers import PeerSetting, roundtrip_of
from kvcx.quality.scoring import (  # noqa: F401
    PerplexityRun,
    Roundtrip,
    WindowCallback,
    check_window,
    compare_prefix,
    forward_hidden,
    identity_roundtrip,
    next_token_divergence,
    score_hidden,
    sequence_nll,
    window_starts,
)

DEFAULT_THRESHOLD = 0.5
DEFAULT_WINDOW = 1024
DEFAULT_STRIDE = 512
PHASES = 6
MODES = ("prefix", "generation", "engine")

PhaseCallback = Callable[[int, int, str], None]


@dataclass
class ValidationResult:
    baseline_perplexity: float
    compressed_perplexity: float
    delta: float
    delta_percent: float
    compression_ratio: float          # FP16 bytes of the cache / packed bytes (as the seeds and peers report)
    rmse: float                       # absolute, in the cache's units
    snr_db: float
    cosine_similarity: float
    passed: bool
    threshold: float
    bits_per_value: float = 0.0
    relative_rmse: float = 0.0        # RMSE / RMS of the exact cache: scale-free
    kld: float = 0.0                  # mean KL(exact || compressed) of the next-token distributions, nats/token
    top1_agreement: float = 0.0       # fraction of scored tokens with the same most likely next token
    compression_ratio_vs_cache_dtype: float = 0.0   # vs the cache as the model holds it (FP32 on CPU)
    cache_dtype: str = ""
    max_error: float = 0.0
    quality_level: str = ""           # the reference design's level on absolute RMSE/SNR (TinyLlama scale)
    tokens_scored: int = 0
    windows: int = 0
    window: int = 0
    stride: int = 0
    mode: str = "prefix"
    model: str = ""
    device: str = ""
    config: dict = field(default_factory=dict)
    wall_time_s: float = 0.0
    codec_time_s: float = 0.0
    quick_test: bool = False
    violations: List[str] = field(default_factory=list)
    setting: str = ""                 # the setting's label (its --scheme, or the plan's name)
    backend: str = ""                 # where the cache was compressed: "triton" (on the device) or "cpu"

    def to_dict(self) -> dict:
        return json_safe(asdict(self))

    def verdict_line(self) -> str:
        word = "PASSED" if self.passed else "FAILED"
        if self.quick_test:
            return (f"{word}: quick test RMSE {self.rmse:.4f}, SNR {self.snr_db:.2f} dB, cosine "
                    f"{self.cosine_similarity:.5f}" + (f" ({'; '.join(self.violations)})" if self.violations else ""))
        return (f"{word}: perplexity delta {self.delta:+.4f} ({self.delta_percent:+.2f}%) "
                f"{'<' if self.passed else '>='} threshold {self.threshold}")


def perplexity_prefix(model, ids, starts: List[int], window: int, stride: int, roundtrip: Roundtrip,
                      on_window: Optional[WindowCallback] = None) -> PerplexityRun:
    """Prefix mode: compress each window's context cache once, score the continuation on both caches."""
    return compare_prefix(model, ids, starts, window, stride, {"kvcx": roundtrip}, on_window)["kvcx"]

def perplexity_generation(model, ids, starts: List[int], window: int, stride: int, config: KVConfig,
                          residual_length: int = 128, on_window: Optional[WindowCallback] = None,
                          backend: Optional[str] = None) -> PerplexityRun:
    """Generation mode: every key/value goes through KvcxCache as the model runs over the window.

    The window is fed in chunks of ``residual_length`` tokens, so each chunk attends to all earlier
    tokens in packed INT4 form (plus the full-precision residual), as during generation. With a press
    (a :class:`~kvcx.presses.PressedSetting`) the window's context is the prompt: one prefill, which the
    press prunes (KvcxCache runs it through the ``"kvcx"`` attention, set for the run), then the continuation in
    chunks.
    """
    import torch

    from kvcx.cache.kvcx_cache import KvcxCache

    dev = next(model.parameters()).device
    run = PerplexityRun()
    ctx_len = window - stride
    pressed = isinstance(config, PressedSetting)
    from kvcx.cache.attention_fn import kvcx_attention

    with kvcx_attention(model) if pressed else contextlib.nullcontext():
        with torch.inference_mode():
            for w, a in enumerate(starts):
                win = ids[a:a + window][None].to(dev)
                targets = win[0, ctx_len + 1:]
                base_hidden = forward_hidden(model, win)[0][ctx_len:-1]
                cache = KvcxCache(model.config, kv_config=config, residual_length=residual_length, backend=backend)
                if pressed:   # the context is the prompt: one prefill, pruned, then the continuation
                    forward_hidden(model, win[:, :ctx_len], cache, chunk=ctx_len)
                    comp_hidden = forward_hidden(model, win[:, ctx_len:], cache, chunk=residual_length)[0][:-1]
                else:
                    comp_hidden = forward_hidden(model, win, cache, chunk=residual_length)[0][ctx_len:-1]
                _generation_window(model, run, cache, base_hidden, comp_hidden, targets)
                if on_window:
                    on_window(w + 1, len(starts))
    return run


def _generation_window(model, run: PerplexityRun, cache, base_hidden, comp_hidden, targets) -> None:
    """One generation-mode window's scores and the cache's bytes, counted whole, added to ``run``."""
    mem = cache.memory_report()
    base, comp, divergence = score_hidden(model, base_hidden, comp_hidden, targets)
    run.add_window(base, comp, targets.numel(), mem["model_dtype_equivalent_bytes"], mem["total_bytes"],
                   mem["fp16_equivalent_bytes"] // 2, cache.kernel_time_s, divergence=divergence)

def perplexity_engine(model, ids, starts: List[int], window: int, stride: int, config: KVConfig,
                      on_window: Optional[WindowCallback] = None, backend: Optional[str] = None) -> PerplexityRun:
    """Engine mode: as vLLM and llama.cpp do, every key and value (the current token's included) is written
    through the codec before attention reads it: the window runs over a cache whose ``update`` stores and returns
    the codec's round trip of each layer's new states, in chunks of ``FORWARD_CHUNK`` (1,024) tokens as an
    engine's chunked prefill writes them (a window of up to 1,024 tokens is one pass). The last ``stride`` tokens
    are scored against the exact pass, as in the other modes."""
    import torch
    from transformers import DynamicCache

    from kvcx.codecs.tensors import numpy_to_torch, torch_to_numpy

    sizes = [0, 0, 0]       # bytes as the model holds them, bytes written by the codec, values

    class _WrittenThroughCodec(DynamicCache):
        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            cfg = config.for_layer(layer_idx)
            # keys coded before RoPE: this chunk's tokens follow the layer's cached ones
            frame = config.key_rope.at(self.get_seq_length(layer_idx)) if config.key_rope is not None else None
            out = []
            for codec, t in ((cfg.key, key_states), (cfg.value, value_states)):
                if not codec.supports(tuple(t.shape)):
                    codec = config.fallback
                if backend == "triton":   # on the device, where the states are
                    p = codec.with_backend("triton").encode(t)
                    sizes[0], sizes[1], sizes[2] = sizes[0] + t.nbytes, sizes[1] + p.nbytes, sizes[2] + t.numel()
                    out.append(codec.with_backend("triton").decode(p))
                    continue
                x = torch_to_numpy(t)
                turn = frame is not None and t is key_states
                p = codec.encode(frame.to_frame(x, f"layer_{layer_idx}_key") if turn else x)
                sizes[0], sizes[1], sizes[2] = sizes[0] + x.nbytes, sizes[1] + p.nbytes, sizes[2] + x.size
                y = codec.decode(p)
                out.append(numpy_to_torch(frame.from_frame(y, f"layer_{layer_idx}_key") if turn else y, t.device))
            return super().update(out[0], out[1], layer_idx, *args, **kwargs)

    dev = next(model.parameters()).device
    run = PerplexityRun()
    ctx_len = window - stride
    with torch.inference_mode():
        for w, a in enumerate(starts):
            win = ids[a:a + window][None].to(dev)
            targets = win[0, ctx_len + 1:]
            base_hidden = forward_hidden(model, win)[0][ctx_len:-1]
            t, sizes[:] = time.perf_counter(), [0, 0, 0]
            comp_hidden = forward_hidden(model, win, _WrittenThroughCodec(config=model.config))[0][ctx_len:-1]
            elapsed = time.perf_counter() - t
            base, comp, divergence = score_hidden(model, base_hidden, comp_hidden, targets)
            run.add_window(base, comp, targets.numel(), sizes[0], sizes[1], sizes[2], elapsed, divergence=divergence)
            if on_window:
                on_window(w + 1, len(starts))
    return run

def run_validation(config: KVConfig, threshold: float = DEFAULT_THRESHOLD, model: Optional[str] = None,
                   dataset_file=None, window: Optional[int] = None, stride: int = DEFAULT_STRIDE,
                   max_windows: int = 32, mode: str = "prefix", cpu: bool = False, device=None,
                   on_phase: Optional[PhaseCallback] = None, on_window: Optional[WindowCallback] = None,
                   roundtrip: Optional[Roundtrip] = None, loaded=None, backend: Optional[str] = None) -> ValidationResult:
    """The six phases of ``kvcx validate`` for one setting (see :func:`run_validations`)."""
    return run_validations({config.scheme: config}, threshold=threshold, model=model, dataset_file=dataset_file,
                           window=window, stride=stride, max_windows=max_windows, mode=mode, cpu=cpu, device=device,
                           on_phase=on_phase, on_window=on_window,
                           roundtrips={config.scheme: roundtrip} if roundtrip else None, loaded=loaded,
                           backend=backend)[0]


def run_validations(configs: Mapping[str, KVConfig], threshold: float = DEFAULT_THRESHOLD,
                    model: Optional[str] = None, dataset_file=None, window: Optional[int] = None,
                    stride: int = DEFAULT_STRIDE, max_windows: int = 32, mode: str = "prefix", cpu: bool = False,
                    device=None, on_phase: Optional[PhaseCallback] = None,
                    on_window: Optional[WindowCallback] = None, roundtrips: Optional[Mapping[str, Roundtrip]] = None,
                    loaded=None, backend: Optional[str] = None) -> List[ValidationResult]:
    """The six phases of ``kvcx validate`` for several settings (label -> KVConfig) on the same windows and
    tokens: one result per setting, in order. In prefix mode each window's context runs once, its exact
    continuation is scored once, and each setting adds one compressed pass (a setting alone costs the same
    three passes). ``loaded`` = (model, tokenizer, name) skips loading; ``roundtrips`` replace a setting's
    codec round trip (by label). ``backend``: where kvcx's settings compress the cache: None (by the model's
    device: the Triton kernels on CUDA for 4-bit integer, E8P and widths codecs), "triton" (forced: the interpreter
    runs it on CPU) or "cpu"; each result says which ran.

    Every input (options, evaluation text, model path and packages) is resolved before the model loads.

    Started by ``torchrun`` or ``accelerate launch`` with several processes (:mod:`kvcx.quality.ranks`), each rank
    scores every N-th window and rank 0 returns the results of all of them (the sums of a one-process run); the
    other ranks report no progress and return an empty list.
    """
    t_start = time.perf_counter()

    def phase(step: int, message: str) -> None:
        if on_phase:
            on_phase(step, PHASES, message)

    if not configs:
        raise KvcxError("no setting to validate: give at least one scheme")
    if mode not in MODES:
        raise KvcxError(f"mode={mode!r} must be one of {', '.join(repr(m) for m in MODES)}")
    if not (threshold > 0 and math.isfinite(threshold)):
        raise KvcxError(f"threshold={threshold} must be a positive number")
    outside = [label for label, cfg in configs.items() if isinstance(cfg, PeerSetting)]
    if outside and mode != "prefix":
        raise KvcxError(f"scheme={','.join(outside)} runs through its own library on the context's cache: prefix "
                        f"mode only, not mode={mode!r}")
    pressed = [label for label, cfg in configs.items() if isinstance(cfg, PressedSetting)]
    if pressed and mode == "engine":
        raise KvcxError(f"scheme={pressed[0]}: a press evicts a prefilled context's tokens; engine mode writes each "
                        "token through the codec as it comes: use --mode prefix or --mode generation")
    for label in outside + pressed:
        configs[label].check_installed()
    turned = [label for label, cfg in configs.items() if getattr(cfg, "key_rope", None) is not None]
    if turned and mode == "generation":
        raise KvcxError(f"setting {turned[0]!r} codes keys before RoPE, which KvcxCache (generation mode) does not "
                        "yet: validate it with --mode prefix or --mode engine")
    # the context limit is checked again once the model is known
    check_window(DEFAULT_WINDOW if window is None else window, stride, max_windows, context_limit=1 << 62)
    if max_windows:   # fewer windows than ranks: refused before the model loads (the text's own count, below)
        planned = ranks.planned()
        planned.check_enough(max_windows, "window", f"give --max-windows {planned.size} or more")
    if backend is not None:   # a bad or impossible --backend fails here, not after the model loads
        for cfg in configs.values():
            if not isinstance(cfg, (PeerSetting, PressedSetting)):
                backend_of(cfg, "cpu", backend)
    text = load_dataset_text(dataset_file)
    source = resolve_model(model) if loaded is None else None
    device = ranks.local_device(device, cpu)
    rank = ranks.join(next(loaded[0].parameters()).device.type if loaded is not None else
                      pick_device(device, cpu).type)
    ranks.same_request(rank, {"settings": dict(configs), "text": text, "model": str(source or loaded[2]),
                              "window": window, "stride": stride, "max_windows": max_windows, "mode": mode,
                              "threshold": threshold, "backend": backend})
    if not rank.leads:   # rank 0 reports
        on_phase = on_window = None
    phase(1, f"evaluation text: {len(text):,} characters")
    m, tok, name = loaded if loaded is not None else load_model_and_tokenizer(source, device=device, cpu=cpu)
    import torch

    dev = next(m.parameters()).device
    text_cfg = text_config(m.config)   # a multimodal class (Gemma 3/4 as AutoModelForCausalLM loads them): its decoder's
    ctx_limit = int(getattr(text_cfg, "max_position_embeddings", DEFAULT_WINDOW) or DEFAULT_WINDOW)
    window = min(DEFAULT_WINDOW, ctx_limit) if window is None else window
    check_window(window, stride, max_windows, ctx_limit)
    phase(2, f"model: {name} on {dev} ({next(m.parameters()).dtype}), {text_cfg.num_hidden_layers} layers")
    if pressed and mode == "prefix":   # every layer's copy evicted (generation: KvcxCache refuses what it cannot)
        refuse_press(m.config, whole_model=True)
    configs = {label: model_frame(engine_setting(cfg, m.config), m) for label, cfg in configs.items()}
    # peers run in their library; a press and its codec on the host (the eviction is numpy's)
    dims = model_dims(m.config)
    backends = {label: "" if isinstance(cfg, PeerSetting) else "cpu" if isinstance(cfg, PressedSetting)
                else backend_of(cfg, dev.type, backend, dims) for label, cfg in configs.items()}
    ids = torch.tensor(tok(text, return_tensors=None)["input_ids"], dtype=torch.long)
    starts = window_starts(ids.numel(), window, stride, max_windows)
    rank.check_enough(len(starts), "window", f"give --max-windows {rank.size} or more")
    phase(3, f"tokenized: {ids.numel():,} tokens, {len(starts)} windows of {window} (stride {stride})"
             f"{f'; {rank.size} ranks: rank r scores windows r, r + {rank.size}, ...' if rank.size > 1 else ''}")
    mine = rank.shard(starts)
    what = (f"codec: {next(iter(configs.values())).describe()}" if len(configs) == 1 else
            f"{len(configs)} settings: {', '.join(configs)}")
    where = ", ".join(sorted({b for b in backends.values() if b}))
    phase(4, f"{what}; scoring each window with the exact and with the compressed cache, same tokens ({mode} mode"
             f"{f', {where} kernels' if where else ''})")
    roundtrips = roundtrips or {}
    if mode == "prefix":
        runs = compare_prefix(m, ids, mine, window, stride,
                              {label: roundtrips.get(label) or (DeviceRoundtrip(cfg) if backends[label] == "triton"
                                                                else roundtrip_of(cfg, m.config))
                               for label, cfg in configs.items()}, on_window)
    else:
        score = perplexity_generation if mode == "generation" else perplexity_engine
        runs = {label: score(m, ids, mine, window, stride, cfg, on_window=on_window, backend=backends[label])
                for label, cfg in configs.items()}
    runs = ranks.gather_runs(rank, runs, len(starts))
    if not rank.leads:
        return []
    first = next(iter(runs.values()))
    phase(5, f"baseline perplexity   {first.baseline_ppl:.4f} ({first.tokens:,} tokens)")
    phase(6, "compressed perplexity " + ", ".join(f"{r.compressed_ppl:.4f}" + (f" ({label})" if len(runs) > 1 else "")
                                                  for label, r in runs.items()))
    wall = time.perf_counter() - t_start
    dtype = str(next(m.parameters()).dtype).replace("torch.", "")
    return [_result(label, runs[label], configs[label], threshold, window, stride, mode, name, str(dev), dtype, wall,
                    backends[label]) for label in configs]


def engine_setting(setting, model_config):
    """A kvcx setting as its engine runs it on this model: the layers the engine leaves in the model's dtype kept
    exact (:meth:`KVConfig.engine_layers`: vLLM's TurboQuant on a dense model); other settings as they are."""
    if not isinstance(setting, KVConfig):
        return setting
    from kvcx.cache.layer_types import STATE, layer_specs

    specs = layer_specs(model_config)
    return setting.engine_layers(len(specs), hybrid=any(s.kind == STATE for s in specs))


def _result(label: str, run: PerplexityRun, config: KVConfig, threshold: float, window: int, stride: int, mode: str,
            model: str, device: str, cache_dtype: str, wall: float, backend: str = "") -> ValidationResult:
    base, comp = run.baseline_ppl, run.compressed_ppl
    delta = comp - base
    s = run.stats
    return ValidationResult(
        baseline_perplexity=base, compressed_perplexity=comp, delta=delta, delta_percent=100.0 * delta / base,
        compression_ratio=run.ratio_vs_fp16, bits_per_value=run.bits_per_value,
        compression_ratio_vs_cache_dtype=run.original_bytes / run.packed_bytes if run.packed_bytes else 0.0,
        cache_dtype=cache_dtype,
        rmse=s.rmse, relative_rmse=s.relative_rmse, snr_db=s.snr_db, cosine_similarity=s.cosine_similarity,
        kld=run.mean_kld, top1_agreement=run.top1_agreement,
        max_error=s.max_error, quality_level=quality_level(s.rmse, s.snr_db) if s.n else "",
        passed=delta < threshold, threshold=threshold,
        tokens_scored=run.tokens, windows=run.windows, window=window, stride=stride, mode=mode, model=model,
        device=device, config=config.get_config(), wall_time_s=wall, codec_time_s=run.codec_time_s, setting=label,
        backend=backend)


def quick_test(config: KVConfig, seq_len: int = 128, seed: int = 0, thresholds: Optional[Thresholds] = None,
               on_phase: Optional[PhaseCallback] = None, label: Optional[str] = None) -> ValidationResult:
    """No model: a synthetic cache of TinyLlama's shape (22 layers x [1, 4, seq, 64] FP16), judged on
    RMSE / SNR / cosine against the reference thresholds. ``label``: the setting's name (its scheme)."""
    from kvcx.quality.bridge import (
        TINYLLAMA_HEAD_DIM,
        TINYLLAMA_NUM_KV_HEADS,
        TINYLLAMA_NUM_LAYERS,
        original_nbytes,
        roundtrip_tensors,
    )

    t = time.perf_counter()
    rng = np.random.default_rng(seed)
    tensors = {}
    for i in range(TINYLLAMA_NUM_LAYERS):
        shape = (1, TINYLLAMA_NUM_KV_HEADS, seq_len, TINYLLAMA_HEAD_DIM)
        # keys: a few outlier channels, as real post-RoPE keys have; values: plain Gaussian
        k = rng.standard_normal(shape).astype(np.float32)
        k[..., rng.choice(TINYLLAMA_HEAD_DIM, 4, replace=False)] *= 4.0
        tensors[f"layer_{i}_key"] = (0.5 * k).astype(np.float16)
        tensors[f"layer_{i}_value"] = (0.5 * rng.standard_normal(shape)).astype(np.float16)
    if on_phase:
        on_phase(1, 1, f"quick test: synthetic TinyLlama-shaped cache ({TINYLLAMA_NUM_LAYERS} layers x "
                       f"[1, {TINYLLAMA_NUM_KV_HEADS}, {seq_len}, {TINYLLAMA_HEAD_DIM}] FP16), {config.describe()}")
    _, nbytes, s = roundtrip_tensors(tensors, config)
    violations = check_thresholds(s, thresholds or Thresholds())
    orig = original_nbytes(tensors)
    return ValidationResult(
        baseline_perplexity=float("nan"), compressed_perplexity=float("nan"), delta=float("nan"),
        delta_percent=float("nan"), compression_ratio=2.0 * s.n / nbytes, compression_ratio_vs_cache_dtype=orig / nbytes,
        cache_dtype="float16", rmse=s.rmse, relative_rmse=s.relative_rmse, snr_db=s.snr_db,
        cosine_similarity=s.cosine_similarity, max_error=s.max_error, quality_level=quality_level(s.rmse, s.snr_db),
        passed=not violations, threshold=float("nan"), bits_per_value=8.0 * nbytes / s.n, model="synthetic",
        config=config.get_config(), wall_time_s=time.perf_counter() - t, quick_test=True, violations=violations,
        setting=label or config.scheme)
