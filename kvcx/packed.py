"""The packed kvcx variant of safetensors (see docs/FORMAT.md).

For each compressed tensor ``NAME`` the file holds

- ``NAME.kvcx.codes``  U8   packed codes (optionally LZ4-framed),
- ``NAME.kvcx.scales`` F16  one scale per group,
- ``NAME.kvcx.zeros``  F16  one zero point per group (asymmetric scheme only),
- ``NAME.kvcx.sinks``  original dtype, the exact first tokens (when sinks > 0),

and ``__metadata__`` records the format marker, version, the codec settings and
every tensor's original dtype and shape, so a file always decodes with the
settings it was written with. Other tensors pass through unchanged under their
own names. The file stays a valid safetensors file.
"""
from __future__ import annotations

import json
from typing import Callable, Dict, Optional, Tuple

import numpy as np

from kvcx.codec import IntCodec, Packed, decode_packed
from kvcx.dtypes import dtype_name, numpy_dtype
from kvcx.errors import CodecError, FormatError
from kvcx.kvconfig import KVConfig
from kvcx.metrics import ErrorStats, error_stats

FORMAT_KEY = "kvcx.format"
FORMAT_NAME = "kvcx.packed"
FORMAT_VERSION = "1"
SUFFIXES = (".kvcx.codes", ".kvcx.scales", ".kvcx.zeros", ".kvcx.sinks")


def is_packed(metadata: Dict[str, str]) -> bool:
    return metadata.get(FORMAT_KEY) == FORMAT_NAME


def _lz4():
    try:
        import lz4.frame
    except ImportError:
        raise CodecError("LZ4 needs the 'lz4' package: pip install lz4 (or kvcx[lz4])") from None
    return lz4.frame


def sparsify(x: np.ndarray, fraction: float, name: str = "tensor") -> np.ndarray:
    """A float32 copy of x with the ``fraction`` smallest-magnitude values set to zero."""
    if not 0.0 <= fraction < 1.0:
        raise CodecError(f"sparsity must be in [0, 1), got {fraction}")
    y = np.array(x, dtype=np.float32, copy=True).reshape(-1)
    k = int(fraction * y.size)
    if k:
        idx = np.argpartition(np.abs(y), k - 1)[:k]
        y[idx] = 0.0
    return y.reshape(x.shape)


def compress_tensors(tensors: Dict[str, np.ndarray], config: KVConfig, sparsity: float = 0.0, lz4: bool = False,
                     source_metadata: Optional[Dict[str, str]] = None, sidecar: Optional[dict] = None,
                     stats: Optional[Dict[str, ErrorStats]] = None,
                     progress: Optional[Callable[[str], None]] = None) -> Tuple[Dict[str, np.ndarray], Dict[str, str]]:
    """Encode every float tensor; returns (tensors, metadata) of the packed file.

    If ``stats`` is a dict, it receives each compressed tensor's :class:`ErrorStats`
    (original vs decoded), computed in the same pass.
    """
    if not 0.0 <= sparsity < 1.0:
        raise CodecError(f"sparsity must be in [0, 1), got {sparsity}")
    out: Dict[str, np.ndarray] = {}
    info: Dict[str, dict] = {}
    passthrough = []
    for name in tensors:
        if name.endswith(SUFFIXES):
            raise FormatError(f"tensor name {name!r} ends with a kvcx-reserved suffix; rename it")
    for name, arr in tensors.items():
        arr = np.asarray(arr)
        if dtype_name(arr.dtype) is None or arr.size == 0:
            out[name] = arr
            passthrough.append(name)
            if progress:
                progress(name)
            continue
        kind, codec = config.codec_for(name, arr.shape)
        src = sparsify(arr, sparsity, name).astype(arr.dtype) if sparsity else arr
        packed = codec.encode(src, name=name)
        codes = packed.codes
        if lz4:
            codes = np.frombuffer(_lz4().compress(codes.tobytes(), compression_level=0), dtype=np.uint8)
        out[f"{name}.kvcx.codes"] = codes
        out[f"{name}.kvcx.scales"] = packed.scales
        if packed.zeros is not None:
            out[f"{name}.kvcx.zeros"] = packed.zeros
        if packed.sinks is not None:
            out[f"{name}.kvcx.sinks"] = packed.sinks
        info[name] = {"dtype": packed.dtype, "shape": list(packed.shape), "codec": kind}
        if stats is not None:
            stats[name] = error_stats(arr, decode_packed(packed, name=name), name=name)
        if progress:
            progress(name)
    meta = {
        FORMAT_KEY: FORMAT_NAME,
        "kvcx.format_version": FORMAT_VERSION,
        "kvcx.config": json.dumps({"scheme": config.scheme, "sparsity": float(sparsity), "lz4": bool(lz4)},
                                  sort_keys=True, separators=(",", ":")),
        "kvcx.codecs": json.dumps({k: c.get_config() for k, c in config.codecs().items()},
                                  sort_keys=True, separators=(",", ":")),
        "kvcx.tensors": json.dumps(info, sort_keys=True, separators=(",", ":")),
        "kvcx.passthrough": json.dumps(passthrough, separators=(",", ":")),
    }
    if source_metadata:
        meta["kvcx.source_metadata"] = json.dumps(source_metadata, sort_keys=True, separators=(",", ":"))
    if sidecar is not None:
        meta["kvcx.sidecar"] = json.dumps(sidecar, sort_keys=True, separators=(",", ":"))
    return out, meta


def _json_field(metadata: Dict[str, str], key: str, source: str, default=None):
    if key not in metadata:
        if default is not None:
            return default
        raise FormatError(f"{source}: kvcx metadata {key!r} is missing; the packed file is damaged")
    try:
        return json.loads(metadata[key])
    except ValueError:
        raise FormatError(f"{source}: kvcx metadata {key!r} is not valid JSON; the packed file is damaged") from None


def packed_tensors(tensors: Dict[str, np.ndarray], metadata: Dict[str, str],
                   source: str = "<packed>") -> Dict[str, Packed]:
    """The :class:`Packed` records of a packed file (codes LZ4-decompressed)."""
    if not is_packed(metadata):
        raise FormatError(f"{source}: not a kvcx packed file (no {FORMAT_KEY!r}={FORMAT_NAME!r} in __metadata__); "
                          "use `kvcx compress` to make one")
    version = metadata.get("kvcx.format_version")
    if version != FORMAT_VERSION:
        raise FormatError(f"{source}: packed format version {version!r} is not supported by this kvcx "
                          f"(reads version {FORMAT_VERSION}); upgrade kvcx")
    info = _json_field(metadata, "kvcx.tensors", source)
    codecs = _json_field(metadata, "kvcx.codecs", source)
    settings = _json_field(metadata, "kvcx.config", source)
    if not isinstance(info, dict) or not isinstance(codecs, dict) or not isinstance(settings, dict):
        raise FormatError(f"{source}: kvcx metadata 'kvcx.tensors', 'kvcx.codecs' and 'kvcx.config' must be objects")
    lz4 = bool(settings.get("lz4", False))
    result = {}
    for name, rec in info.items():
        try:
            dtype, shape = rec["dtype"], tuple(int(s) for s in rec["shape"])
            codec = IntCodec.from_config(codecs[rec["codec"]])
            numpy_dtype(dtype)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            if isinstance(exc, CodecError):
                raise FormatError(f"{source}: tensor {name!r}: {exc}") from None
            raise FormatError(f"{source}: kvcx metadata for tensor {name!r} is incomplete or invalid") from None
        try:
            cfg = codec.packed_config(shape, name)
            nbytes = codec.codes_nbytes(shape, name)
        except CodecError as exc:
            raise FormatError(f"{source}: {exc}") from None
        for part in ("codes", "scales"):
            if f"{name}.kvcx.{part}" not in tensors:
                raise FormatError(f"{source}: tensor {name!r} is missing its {name}.kvcx.{part} entry")
        codes = tensors[f"{name}.kvcx.codes"]
        if codes.dtype != np.uint8 or codes.ndim != 1:
            raise FormatError(f"{source}: {name}.kvcx.codes must be a 1-D U8 tensor")
        if lz4:
            try:
                codes = np.frombuffer(_lz4().decompress(codes.tobytes()), dtype=np.uint8)
            except RuntimeError:
                raise FormatError(f"{source}: LZ4 data of tensor {name!r} is corrupt") from None
        if codes.size != nbytes:
            raise FormatError(f"{source}: tensor {name!r} has {codes.size} code bytes, metadata says {nbytes}")
        scales = tensors[f"{name}.kvcx.scales"]
        zeros = tensors.get(f"{name}.kvcx.zeros")
        for part, arr in (("scales", scales), ("zeros", zeros)):
            if arr is not None and arr.dtype != np.float16:
                raise FormatError(f"{source}: {name}.kvcx.{part} must be F16, got {arr.dtype}")
        result[name] = Packed(codes=codes, scales=scales, zeros=zeros, sinks=tensors.get(f"{name}.kvcx.sinks"),
                              shape=shape, dtype=dtype, config=cfg)
    return result


def decompress_tensors(tensors: Dict[str, np.ndarray], metadata: Dict[str, str], source: str = "<packed>",
                       n_threads: Optional[int] = None,
                       progress: Optional[Callable[[str], None]] = None) -> Dict[str, np.ndarray]:
    """Restore every tensor (names, shapes, dtypes) of a packed file."""
    packed = packed_tensors(tensors, metadata, source)
    out: Dict[str, np.ndarray] = {}
    for name in _json_field(metadata, "kvcx.passthrough", source, default=[]):
        if name not in tensors:
            raise FormatError(f"{source}: pass-through tensor {name!r} is missing")
        out[name] = tensors[name]
    for name, p in packed.items():
        try:
            out[name] = decode_packed(p, name=name, n_threads=n_threads)
        except CodecError as exc:
            raise FormatError(f"{source}: {exc}") from None
        if progress:
            progress(name)
    return out


def settings_of(metadata: Dict[str, str]) -> dict:
    """Scheme, sparsity, LZ4 flag and the key/value codec configs recorded in a packed file."""
    return {**json.loads(metadata["kvcx.config"]), "codecs": json.loads(metadata["kvcx.codecs"])}


def original_metadata(metadata: Dict[str, str]) -> Tuple[Optional[Dict[str, str]], Optional[dict]]:
    """(the input file's own __metadata__, its sidecar) as recorded in a packed file."""
    src = json.loads(metadata["kvcx.source_metadata"]) if "kvcx.source_metadata" in metadata else None
    side = json.loads(metadata["kvcx.sidecar"]) if "kvcx.sidecar" in metadata else None
    return src, side
