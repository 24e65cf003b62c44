"""The file API (the reference design's bridge, in-process, no torch): files in, files out, metrics.

>>> m = compress_kv_cache("cache.safetensors", "cache.kvcx.safetensors", group_size=64)
>>> m.compression_ratio, m.snr_db, m.passed
>>> decompress_kv_cache("cache.kvcx.safetensors", "restored.safetensors")
>>> get_compression_metrics("cache.safetensors")          # quality only, no file written
>>> load_plan("smollm2-kvcx2w-2.47")                      # a shipped plan by name, or a plan file's path
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import asdict, dataclass, field
from importlib import resources
from typing import Callable, Dict, List, Optional

import numpy as np

from kvcx.codecs.dtypes import dtype_name
from kvcx.codecs.kvconfig import DEFAULT_SCHEME, SCHEME_NAMES, KVConfig, layer_of, tensor_kind
from kvcx.codecs.plan_record import check_plan_record
from kvcx.codecs.rope import MODEL
from kvcx.codecs.metrics import (  # noqa: F401
    COSINE_THRESHOLD,
    RMSE_THRESHOLD,
    SNR_THRESHOLD_DB,
    ErrorStats,
    Thresholds,
    check_thresholds,
    error_stats,
    json_safe,
    quality_level,
)
from kvcx.errors import CodecError, FormatError, KvcxError
from kvcx.formats import safetensors as st
from kvcx.formats.atomic import OutputSet, check_distinct, check_output_path
from kvcx.formats.jsonio import read_json_object, read_sidecar, sidecar_path, write_json_to
from kvcx.formats.packed import Choice, compress_tensors, decompress_tensors, is_packed, original_metadata, settings_of

log = logging.getLogger("kvcx")


@dataclass
class TensorMetrics:
    name: str
    shape: list
    dtype: str
    codec: str
    rmse: float
    relative_rmse: float
    snr_db: float
    cosine_similarity: float
    max_error: float


@dataclass
class CompressionMetrics:
    """Size and quality of one compression. ``compression_ratio`` is against FP16 (the FP16 bytes of the
    float tensors plus any pass-through tensors, over the packed file's bytes); ``file_size_ratio`` is
    input file bytes over output file bytes, in the input's own dtype. ``passed``/``violations`` are the
    reference design's verdict on absolute RMSE, SNR and cosine."""

    compression_ratio: float
    original_size_bytes: int
    compressed_size_bytes: int
    rmse: float
    snr_db: float
    cosine_similarity: float
    max_error: float
    quality_level: str
    processing_time_ms: float
    passed: bool
    violations: List[str]
    bits_per_value: float
    num_values: int
    config: dict
    relative_rmse: float = 0.0
    fp16_size_bytes: int = 0
    file_size_ratio: float = 0.0
    tensors: List[TensorMetrics] = field(default_factory=list)
    warnings: List[str] = field(default_factory=list)   # what a user would not expect, each one line (see surprises)

    def to_dict(self) -> dict:
        return json_safe(asdict(self))


def write_sidecar(path, data: dict) -> None:
    """Write ``<path>.metadata.json`` on its own (atomically)."""
    with OutputSet([sidecar_path(path)]) as tmp:
        write_json_to(tmp[sidecar_path(path)], sidecar_path(path), data)


def plan_outputs(input_path, output_path, with_sidecar: bool) -> OutputSet:
    """The outputs of one command (the file, and its sidecar or the removal of a stale one), checked
    before any work: none of them is an input (main file or sidecar), and each can be written."""
    inputs = [input_path] + ([sidecar_path(input_path)] if os.path.lexists(sidecar_path(input_path)) else [])
    check_distinct(inputs, [output_path, sidecar_path(output_path)])
    side = sidecar_path(output_path)
    outs = OutputSet([output_path, side] if with_sidecar else [output_path], remove=[] if with_sidecar else [side])
    outs.check()
    check_output_path(side)  # a directory in the sidecar's place blocks the command before any work
    return outs


def _commit(outs: OutputSet, output_path, tensors, meta, sidecar: Optional[dict]) -> None:
    with outs as tmp:
        st.write_to(tmp[os.fspath(output_path)], output_path, tensors, meta)
        if sidecar is not None:
            write_json_to(tmp[sidecar_path(output_path)], sidecar_path(output_path), sidecar)


def open_plain(input_path) -> st.SafeFile:
    """A plain (not packed) safetensors file, opened."""
    f = st.SafeFile(input_path)
    if is_packed(f.metadata):
        f.close()
        raise FormatError(f"{input_path}: is already a kvcx packed file; `kvcx decompress` it first")
    return f


def measure(tensors, chosen: Dict[str, Choice], n_threads: Optional[int] = None) -> Dict[str, ErrorStats]:
    """Each compressed tensor's :class:`ErrorStats`: the original against the decode of what was chosen."""
    return {name: error_stats(tensors[name], c.decoded(name), name=name, n_threads=n_threads)
            for name, c in chosen.items()}


def _span(layers) -> str:
    layers = sorted(layers)
    return f"{layers[0]}-{layers[-1]}" if len(layers) > 1 and layers[-1] - layers[0] == len(layers) - 1 else \
        ", ".join(map(str, layers))


def surprises(names, config: KVConfig, bits_per_value: float) -> List[str]:
    """What compressing these tensors did that a user would not expect, one line each: tensors whose names say
    neither key nor value (they get the value codec), a per-layer plan whose layers are not the cache's, a packed
    size above FP16's (a cache of a few tokens is mostly scales)."""
    names = list(names)
    out = []
    unnamed = [n for n in names if tensor_kind(n) is None]
    if unnamed:
        shown = ", ".join(unnamed[:3]) + (f" and {len(unnamed) - 3} more" if len(unnamed) > 3 else "")
        out.append(f"{len(unnamed)} tensor(s) ({shown}) name neither key nor value: compressed with the value codec; "
                   "name them like layer_0_key / layer_0_value (or past_key_values.0.0 / .0.1)")
    planned = {L for L, _, _ in config.layer_bits} | {L for L, _ in config.key_weights}
    held = {L for L in (layer_of(n) for n in names) if L is not None}
    if held and planned - held:
        out.append(f"the plan sets layers {_span(planned - held)}, which the cache (layers {_span(held)}) does not hold: "
                   "a plan is made for one model (`kvcx calibrate` one for this cache's model)")
    if bits_per_value > 16:
        out.append(f"the packed file holds {bits_per_value:.1f} bits a value, more than FP16's 16: its tensors are too "
                   "short for group scales and headers to pay (compress a cache of at least a few hundred tokens)")
    return out


def _metrics(f: st.SafeFile, chosen: Dict[str, Choice], original_size: int, compressed_size: int,
             seconds: float, meta: Dict[str, str], thresholds: Thresholds, config: KVConfig) -> CompressionMetrics:
    total = ErrorStats()
    per = []
    for name, s in measure(f.tensors(), chosen).items():
        total += s
        shape, dtype = f.shape_and_dtype(name)
        per.append(TensorMetrics(name=name, shape=list(shape), dtype=str(dtype), codec=chosen[name].kind,
                                 rmse=s.rmse, relative_rmse=s.relative_rmse, snr_db=s.snr_db,
                                 cosine_similarity=s.cosine_similarity, max_error=s.max_error))
    violations = check_thresholds(total, thresholds) if total.n else ["no float tensors to compress"]
    bpv = 8.0 * compressed_size / total.n if total.n else 0.0
    fp16 = 0
    for name in f.keys():
        shape, dtype = f.shape_and_dtype(name)
        n = int(np.prod(shape, dtype=np.int64))
        fp16 += 2 * n if dtype_name(dtype) else n * dtype.itemsize
    return CompressionMetrics(
        compression_ratio=fp16 / compressed_size if compressed_size else 0.0,
        fp16_size_bytes=int(fp16), file_size_ratio=original_size / compressed_size if compressed_size else 0.0,
        relative_rmse=total.relative_rmse,
        original_size_bytes=int(original_size), compressed_size_bytes=int(compressed_size),
        rmse=total.rmse, snr_db=total.snr_db, cosine_similarity=total.cosine_similarity,
        max_error=total.max_error, quality_level=quality_level(total.rmse, total.snr_db) if total.n else "POOR",
        processing_time_ms=seconds * 1000.0, passed=not violations, violations=violations,
        bits_per_value=bpv, num_values=int(total.n), config=settings_of(meta), tensors=per,
        warnings=surprises(chosen, config, bpv) + (
            [] if total.n else [f"no float tensors: nothing was compressed, its {len(f.keys())} tensor(s) are stored "
                                "as they are (kvcx packs float16, bfloat16 and float32 keys and values)"]))


def _config(config: Optional[KVConfig], scheme: Optional[str], group_size: Optional[int], n_threads) -> KVConfig:
    if config is not None:
        return config
    return KVConfig.from_scheme(scheme or DEFAULT_SCHEME, group_size=group_size, n_threads=n_threads)


def compress_kv_cache(input_path, output_path, group_size: Optional[int] = None, sparsity: float = 0.0, verbose: bool = False,
                      scheme: Optional[str] = None, config: Optional[KVConfig] = None, lz4: bool = False,
                      n_threads: Optional[int] = None, thresholds: Optional[Thresholds] = None,
                      progress: Optional[Callable[[str], None]] = None) -> CompressionMetrics:
    """Compress a safetensors KV cache into a packed kvcx file (written atomically)."""
    t = time.perf_counter()
    cfg = _config(config, scheme, group_size, n_threads)
    with open_plain(input_path) as f:
        sidecar = read_sidecar(input_path)
        outs = plan_outputs(input_path, output_path, with_sidecar=sidecar is not None)
        out, meta, chosen = compress_tensors(f.tensors(), cfg, sparsity=sparsity, lz4=lz4,
                                             source_metadata=f.metadata or None, sidecar=sidecar, progress=progress)
        _commit(outs, output_path, out, meta, sidecar)
        m = _metrics(f, chosen, os.path.getsize(input_path), os.path.getsize(output_path), time.perf_counter() - t,
                     meta, thresholds or Thresholds(), cfg)
    if verbose:  # the library logs; rendering is the CLI's
        log.info("%s -> %s: %.2fx vs FP16, relative RMSE %.4f, SNR %.1f dB", input_path, output_path,
                 m.compression_ratio, m.relative_rmse, m.snr_db)
    return m


def decompress_kv_cache(input_path, output_path, n_threads: Optional[int] = None,
                        progress: Optional[Callable[[str], None]] = None) -> dict:
    """Restore a packed kvcx file to a plain safetensors file (names, shapes, dtypes)."""
    t = time.perf_counter()
    with st.SafeFile(input_path) as f:
        if not is_packed(f.metadata):
            raise FormatError(f"{input_path}: is a plain safetensors file, not a kvcx packed file; "
                              "`kvcx compress` makes packed files")
        src_meta, sidecar = original_metadata(f.metadata, source=os.fspath(input_path))
        outs = plan_outputs(input_path, output_path, with_sidecar=sidecar is not None)
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        metadata = f.metadata
    out = decompress_tensors(tensors, metadata, source=os.fspath(input_path), n_threads=n_threads,
                             progress=progress)
    _commit(outs, output_path, out, src_meta, sidecar)
    return {"input": os.fspath(input_path), "output": os.fspath(output_path), "tensors": len(out),
            "compressed_size_bytes": os.path.getsize(input_path), "restored_size_bytes": os.path.getsize(output_path),
            "processing_time_ms": (time.perf_counter() - t) * 1000.0}


def get_compression_metrics(input_path, group_size: Optional[int] = None, scheme: Optional[str] = None,
                            config: Optional[KVConfig] = None, sparsity: float = 0.0, lz4: bool = False,
                            n_threads: Optional[int] = None, thresholds: Optional[Thresholds] = None,
                            progress: Optional[Callable[[str], None]] = None) -> CompressionMetrics:
    """Quality and size of compressing a file, without writing one (sizes are the real serialized bytes)."""
    t = time.perf_counter()
    cfg = _config(config, scheme, group_size, n_threads)
    with open_plain(input_path) as f:
        out, meta, chosen = compress_tensors(f.tensors(), cfg, sparsity=sparsity, lz4=lz4,
                                             source_metadata=f.metadata or None, sidecar=read_sidecar(input_path),
                                             progress=progress)
        size = st.serialized_size(out, meta)
        return _metrics(f, chosen, os.path.getsize(input_path), size, time.perf_counter() - t, meta,
                        thresholds or Thresholds(), cfg)


def save_plan(path, calibration) -> None:
    """Write a ``kvcx calibrate`` result (the plan's config, sensitivities, budget) as JSON, atomically."""
    with OutputSet([path]) as tmp:
        write_json_to(tmp[os.fspath(path)], os.fspath(path), calibration.to_dict())


def shipped_plans() -> List[str]:
    """The names of the plans shipped with kvcx (calibrated on the embedded model), for ``load_plan(name)``."""
    return sorted(p.name[:-len(".json")] for p in resources.files("kvcx").joinpath("plans").iterdir()
                  if p.name.endswith(".json"))


def plan_file(plan) -> str:
    """The path of a plan given by path or by a shipped plan's name (a path that exists wins)."""
    p = os.fspath(plan)
    if os.path.exists(p) or os.sep in p or p.endswith(".json"):
        return p
    if p in shipped_plans():
        return os.fspath(resources.files("kvcx").joinpath("plans", p + ".json"))
    raise FormatError(f"{p}: no such plan file, and no shipped plan of that name (shipped: "
                      f"{', '.join(shipped_plans())}); write one with `kvcx calibrate --out {p}.json`")


def read_plan(plan) -> dict:
    """The JSON object of a plan (a file's path, or a shipped plan's name), parsed strictly."""
    p = plan_file(plan)
    if not os.path.exists(p):
        raise FormatError(f"{p}: no such plan file; write one with `kvcx calibrate --out {p}`")
    data = read_json_object(p, "the plan", "write it again with `kvcx calibrate`")
    try:
        return check_plan_record(data, p)
    except CodecError as exc:
        raise FormatError(str(exc)) from None


def load_plan(plan, n_threads: Optional[int] = None):
    """The KVConfig of a plan written by ``kvcx calibrate`` (a file's path, or a shipped plan's name such as
    ``"smollm2-kvcx2w-2.47"``; any JSON object with a ``config`` works). A plan calibrated with a press (keep
    ratios per layer) is a :class:`~kvcx.presses.PressedSetting` of its press and config, which
    ``validate`` and ``KvcxCache(kv_config=...)`` take."""
    p = plan_file(plan)
    data = read_plan(p)
    cfg = data.get("config", data)
    try:
        config = KVConfig.from_config(cfg, n_threads=n_threads)
    except CodecError as exc:
        raise FormatError(f"{p}: {exc}") from None
    if data.get("press") is None or "config" not in data:
        return config
    from kvcx.presses import Press, PressedSetting

    try:
        press = Press.from_config(data["press"], p)
    except KvcxError as exc:
        raise FormatError(str(exc)) from None
    if press.layer_keep and len(press.layer_keep) != int(data.get("n_layers", len(press.layer_keep))):
        raise FormatError(f"{p}: its press gives {len(press.layer_keep)} keep ratios for {data.get('n_layers')} "
                          "layers; calibrate the plan again")
    return PressedSetting(press, config)


def validation_settings(scheme: str, plan=None, gate: Optional[str] = None, group_size: Optional[int] = None,
                        bits: Optional[int] = None, sinks: Optional[int] = None, rotate: Optional[bool] = None,
                        n_threads: Optional[int] = None, peers: Optional[dict] = None, keys_before_rope: bool = False):
    """The settings ``kvcx validate`` compares, label -> KVConfig, and the labels that gate its verdict.

    ``scheme``: one scheme or several, comma-separated (``"kvcx,q4_0-rot,fp8_e4m3"``); a ``plan`` replaces a
    single scheme and joins a list of them (labelled by the plan's name or path). ``gate``: comma-separated
    labels that must pass (default: all). ``peers``: settings by name that are not kvcx's (another library's
    quantizer, built by the caller), taken as they are. ``keys_before_rope``: kvcx's settings code their keys in the
    frame before the model's RoPE (``key_rope="model"``, :mod:`kvcx.codecs.rope`)."""
    labels = [x.strip() for x in str(scheme).split(",") if x.strip()]
    if not labels or len(set(labels)) != len(labels):
        raise CodecError(f"scheme={scheme!r}: name each setting once, comma-separated (e.g. kvcx,q4_0,fp8_e4m3)")
    if plan is not None and len(labels) == 1:
        labels = []
    peers = peers or {}
    given = [f"{k}={v!r}" for k, v in (("group_size", group_size), ("bits", bits), ("sinks", sinks),
                                       ("rotate", rotate)) if v is not None]
    if given and any(x in peers for x in labels):
        raise CodecError(f"scheme={','.join(x for x in labels if x in peers)} runs through its own library with its "
                         f"own settings; leave out {', '.join(given)}")
    from kvcx.presses import PressedSetting, split_scheme

    split = {x: split_scheme(x) for x in labels}       # a press (token eviction) composed by '+', and the codec
    codecs = [c for _, c in split.values() if c is not None]
    unknown = [x for x in codecs if x not in peers and x not in SCHEME_NAMES]
    if unknown and peers:   # (without peers, KVConfig.from_scheme names kvcx's schemes)
        raise CodecError(f"unknown scheme {unknown[0]!r}; use one of {', '.join(SCHEME_NAMES)}, another "
                         f"library's: {', '.join(peers)}, or a press composed by '+' (e.g. kvcx+snapkv:0.5)")

    def codec_of(x):
        if x is None:
            return None
        return peers[x] if x in peers else KVConfig.from_scheme(x, group_size=group_size, bits=bits, sinks=sinks,
                                                                rotate=rotate, n_threads=n_threads)

    configs = {x: codec_of(c) if press is None else PressedSetting(press, codec_of(c))
               for x, (press, c) in split.items()}
    if plan is not None:
        configs[str(plan)] = load_plan(plan, n_threads=n_threads)
    if keys_before_rope:
        other = [x for x, c in configs.items() if not isinstance(c, KVConfig)]
        if other:
            raise CodecError(f"--keys-before-rope codes kvcx's own keys before RoPE; {other[0]!r} is another "
                             "library's setting or a press: validate it without the option")
        configs = {x: c if c.key_rope is not None else c.with_key_rope(MODEL) for x, c in configs.items()}
    gated = [x.strip() for x in gate.split(",") if x.strip()] if gate is not None else list(configs)
    unknown = [g for g in gated if g not in configs]
    if unknown or not gated:
        raise CodecError(f"gate={gate!r}: {', '.join(unknown) or 'nothing'} is not a validated setting; name "
                         f"settings of scheme= ({', '.join(configs)})")
    return configs, gated
