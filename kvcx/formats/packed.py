"""The packed kvcx variant of safetensors (see docs/FORMAT.md).

For each compressed tensor ``NAME`` the file holds

- ``NAME.kvcx.codes``  U8   packed codes (optionally LZ4-framed, with the frame's content checksum),
- ``NAME.kvcx.scales`` F16  one scale per group,
- ``NAME.kvcx.zeros``  F16  one zero point per group (asymmetric scheme only),
- ``NAME.kvcx.sinks``  original dtype, the exact first tokens (when sinks > 0),

and ``__metadata__`` records the format marker, version, the codec settings, every tensor's
original dtype and shape, and (version 2) a CRC-32 over the metadata and all stored tensors, so a file always
decodes with the settings it was written with and a damaged one is refused. Other tensors pass
through unchanged under their own names. The file stays a valid safetensors file.

Reading is strict: every metadata field is checked against its schema (types, ranges, no
duplicate keys, no unknown keys), and every stored tensor must be accounted for.
"""
from __future__ import annotations

import json
import zlib
from typing import Callable, Dict, NamedTuple, Optional, Tuple

import numpy as np

from kvcx.codecs.base import Codec, Packed, decode, get_codec
from kvcx.codecs.dtypes import dtype_name, is_int, numpy_dtype
from kvcx.codecs.rope import KeyRope
from kvcx.errors import CodecError, FormatError
from kvcx.formats.jsonio import check_text, loads_strict

FORMAT_KEY = "kvcx.format"
FORMAT_NAME = "kvcx.packed"
FORMAT_VERSION = "2"
# a file is written as version 2, or as the higher version one of its codecs needs (Codec.format_version):
# 3 with the per-channel widths codec (kvcx.widths, docs/FORMAT.md 2.4), 4 with an engine format's codec
# (llama.cpp, vllm.fp8: docs/FORMAT.md 2.5), 5 with an FP4 codec (fp4: docs/FORMAT.md 2.6), 6 with vLLM's TurboQuant
# records (vllm.turboquant: docs/FORMAT.md 2.7), 7 with E8P lattice records (kvcx.e8p: docs/FORMAT.md 2.8), 8 with
# keys coded before RoPE (kvcx.key_rope: docs/FORMAT.md 2.9; a reader that does not turn them back must refuse them)
READABLE_VERSIONS = ("1", "2", "3", "4", "5", "6", "7", "8")
KEY_ROPE_VERSION = "8"
SUFFIXES = (".kvcx.codes", ".kvcx.scales", ".kvcx.zeros", ".kvcx.sinks")
PARTS = ("codes", "scales", "zeros", "sinks")
_KNOWN_KEYS = {FORMAT_KEY, "kvcx.format_version", "kvcx.config", "kvcx.codecs", "kvcx.tensors",
               "kvcx.passthrough", "kvcx.source_metadata", "kvcx.sidecar", "kvcx.crc32", "kvcx.key_rope"}
_LZ4_MAGIC = b"\x04\x22\x4d\x18"


def is_packed(metadata: Dict[str, str]) -> bool:
    return metadata.get(FORMAT_KEY) == FORMAT_NAME


def _lz4():
    try:
        import lz4.frame
    except ImportError:
        raise CodecError("LZ4 needs the 'lz4' package: pip install lz4 (or kvcx[lz4])") from None
    return lz4.frame


def crc32(tensors: Dict[str, np.ndarray], metadata: Optional[Dict[str, str]] = None) -> str:
    """The file's CRC-32 (zlib's), 8 lowercase hex digits. It covers every ``__metadata__`` entry but
    ``kvcx.crc32`` itself (key, NUL, value, NUL, in key order), then every stored tensor (UTF-8 name,
    then its bytes as stored, in name order): a changed setting is caught like a changed code."""
    crc = 0
    for key in sorted(metadata or {}):
        if key != "kvcx.crc32":
            crc = zlib.crc32(key.encode("utf-8") + b"\0" + metadata[key].encode("utf-8") + b"\0", crc)
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name]).reshape(-1)
        crc = zlib.crc32(name.encode("utf-8"), crc)
        crc = zlib.crc32(memoryview(a.view(np.uint8)), crc)
    return f"{crc & 0xffffffff:08x}"


def lz4_compress(codes: np.ndarray) -> np.ndarray:
    """One LZ4 frame with its content size and content checksum."""
    frame = _lz4().compress(codes.tobytes(), compression_level=0, content_checksum=True, store_size=True)
    return np.frombuffer(frame, dtype=np.uint8)


def lz4_decompress(frame: np.ndarray, nbytes: int, name: str, source: str, need_checksum: bool) -> np.ndarray:
    """Decompress one frame into exactly ``nbytes`` (never more is allocated), checksum verified."""
    data = frame.tobytes()
    if len(data) < 7 or data[:4] != _LZ4_MAGIC:
        raise FormatError(f"{source}: the LZ4 data of tensor {name!r} is not an LZ4 frame; the file is damaged")
    if need_checksum and not data[4] & 0x04:
        raise FormatError(f"{source}: the LZ4 frame of tensor {name!r} has no content checksum; the file is "
                          "damaged or was not written by kvcx")
    d = _lz4().LZ4FrameDecompressor()
    try:
        out = d.decompress(data, max_length=nbytes)
        ok = d.eof and not d.unused_data and len(out) == nbytes
    except (RuntimeError, ValueError, OverflowError, MemoryError) as exc:
        raise FormatError(f"{source}: the LZ4 data of tensor {name!r} is corrupt ({str(exc)[:80]})") from None
    if not ok:
        raise FormatError(f"{source}: the LZ4 data of tensor {name!r} does not decompress to the {nbytes} code "
                          "bytes the metadata promises; the file is damaged")
    return np.frombuffer(out, dtype=np.uint8)


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


def _dumps(obj) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


class Choice(NamedTuple):
    """What :func:`compress_tensors` did with one float tensor: the codec's name in the file (``key``,
    ``value``, ``fallback``, ``key.b4``...), the codec, and the encoded record."""

    kind: str
    codec: Codec
    packed: Packed
    frame: Optional[KeyRope] = None   # keys coded before RoPE: the frame they are turned back from

    def decoded(self, name: str = "tensor") -> np.ndarray:
        """The tensor as a reader of the file restores it (keys coded before RoPE turned back)."""
        y = self.codec.decode(self.packed, name=name)
        return y if self.frame is None else self.frame.from_frame(y, name)


class Compressed(NamedTuple):
    """A packed file in memory: the tensors and ``__metadata__`` to store, and what each tensor got."""

    tensors: Dict[str, np.ndarray]
    metadata: Dict[str, str]
    chosen: Dict[str, Choice]


def compress_tensors(tensors: Dict[str, np.ndarray], config, sparsity: float = 0.0, lz4: bool = False,
                     source_metadata: Optional[Dict[str, str]] = None, sidecar: Optional[dict] = None,
                     progress: Optional[Callable[[str], None]] = None) -> Compressed:
    """Encode every float tensor; returns the packed file's tensors and metadata, and each tensor's choice
    (a caller that wants error statistics decodes ``chosen[name].packed`` with ``chosen[name].codec``).

    ``config`` chooses each tensor's codec: a :class:`kvcx.codecs.KVConfig` (the format needs only its
    ``codec_for``, ``weights_for``, ``codecs`` and ``scheme``)."""
    if isinstance(sparsity, bool) or not isinstance(sparsity, (int, float)) or not 0.0 <= sparsity < 1.0:
        raise CodecError(f"sparsity must be in [0, 1), got {sparsity!r}")
    check_text([list(tensors), source_metadata, sidecar], "the names and metadata to store")
    out: Dict[str, np.ndarray] = {}
    info: Dict[str, dict] = {}
    chosen: Dict[str, Choice] = {}
    passthrough = []
    rope = getattr(config, "key_rope", None)
    if rope is not None and not isinstance(rope, KeyRope):
        raise CodecError("this config codes keys before RoPE with the model's own frequencies (key_rope='model'), "
                         "which only a loaded model knows: give it the model's KeyRope "
                         "(config.with_key_rope(kvcx.codecs.rope.model_key_rope(model))) before writing a file")
    turned = []
    for name in tensors:
        if name.endswith(SUFFIXES):
            raise FormatError(f"tensor name {name!r} ends with a kvcx-reserved suffix; rename it")
    for name, arr in tensors.items():
        arr = np.asarray(arr)
        kind, codec = config.codec_for(name, arr.shape) if dtype_name(arr.dtype) and arr.size else ("", None)
        if codec is None:    # not a float tensor, empty, or in a layer the config keeps exact: stored as it is
            out[name] = arr
            passthrough.append(name)
            if progress:
                progress(name)
            continue
        src = sparsify(arr, sparsity, name).astype(arr.dtype) if sparsity else arr
        if rope is not None and kind.split(".")[0] == "key":   # the keys' codec: coded before RoPE (FORMAT.md 2.9)
            src = rope.to_frame(src, name)
            turned.append(name)
        packed = codec.encode(src, name=name, weights=config.weights_for(name))
        chosen[name] = Choice(kind, codec, packed, rope if turned and turned[-1] == name else None)
        out[f"{name}.kvcx.codes"] = lz4_compress(packed.codes) if lz4 else packed.codes
        out[f"{name}.kvcx.scales"] = packed.scales
        if packed.zeros is not None:
            out[f"{name}.kvcx.zeros"] = packed.zeros
        if packed.sinks is not None:
            out[f"{name}.kvcx.sinks"] = packed.sinks
        info[name] = {"dtype": packed.dtype, "shape": list(packed.shape), "codec": kind}
        if progress:
            progress(name)
    codecs = config.codecs()
    meta = {
        FORMAT_KEY: FORMAT_NAME,
        "kvcx.format_version": max([FORMAT_VERSION] + [c.format_version for c in codecs.values()]
                                   + ([KEY_ROPE_VERSION] if turned else []), key=int),
        "kvcx.config": _dumps({"scheme": config.scheme, "sparsity": float(sparsity), "lz4": bool(lz4)}),
        "kvcx.codecs": _dumps({k: c.get_config() for k, c in codecs.items()}),
        "kvcx.tensors": _dumps(info),
        "kvcx.passthrough": json.dumps(passthrough, separators=(",", ":")),
    }
    if turned:
        meta["kvcx.key_rope"] = _dumps({**rope.get_config(), "tensors": turned})
    if source_metadata:
        meta["kvcx.source_metadata"] = _dumps(source_metadata)
    if sidecar is not None:
        meta["kvcx.sidecar"] = _dumps(sidecar)
    meta["kvcx.crc32"] = crc32(out, meta)
    return Compressed(out, meta, chosen)


# ----------------------------------------------------------------------------
# reading: a strict schema for every metadata field
# ----------------------------------------------------------------------------

def parse_json_field(metadata: Dict[str, str], key: str, source: str, required: bool = True):
    """The JSON value of a packed file's metadata key, parsed strictly."""
    if key not in metadata:
        if not required:
            return None
        raise FormatError(f"{source}: kvcx metadata {key!r} is missing; the packed file is damaged")
    return loads_strict(metadata[key], f"{source}: kvcx metadata {key!r}", "the packed file is damaged")


def _expect(cond: bool, source: str, what: str) -> None:
    if not cond:
        raise FormatError(f"{source}: {what}; the packed file is damaged or was not written by kvcx")


def read_settings(metadata: Dict[str, str], source: str = "<packed>") -> dict:
    """Validate the file-level metadata; returns version, config, codecs, tensors, passthrough, checksums."""
    if not is_packed(metadata):
        raise FormatError(f"{source}: not a kvcx packed file (no {FORMAT_KEY!r}={FORMAT_NAME!r} in __metadata__); "
                          "use `kvcx compress` to make one")
    version = metadata.get("kvcx.format_version")
    if version not in READABLE_VERSIONS:
        raise FormatError(f"{source}: packed format version {version!r} is not supported by this kvcx "
                          f"(reads versions {', '.join(READABLE_VERSIONS)}); upgrade kvcx")
    unknown = sorted(set(metadata) - _KNOWN_KEYS)
    _expect(not unknown, source, f"unknown __metadata__ keys {unknown[:5]}")
    if version == "1":
        _expect("kvcx.crc32" not in metadata, source, "version 1 files carry no 'kvcx.crc32'")
    else:
        crc = metadata.get("kvcx.crc32")
        _expect(isinstance(crc, str) and len(crc) == 8 and all(c in "0123456789abcdef" for c in crc), source,
                "'kvcx.crc32' must be 8 lowercase hex digits")

    settings = parse_json_field(metadata, "kvcx.config", source)
    _expect(isinstance(settings, dict) and set(settings) == {"scheme", "sparsity", "lz4"}, source,
            "'kvcx.config' must be an object with exactly scheme, sparsity and lz4")
    _expect(isinstance(settings["scheme"], str), source, "'kvcx.config' scheme must be a string")
    sp = settings["sparsity"]
    _expect(isinstance(sp, (int, float)) and not isinstance(sp, bool) and 0.0 <= sp < 1.0, source,
            "'kvcx.config' sparsity must be a number in [0, 1)")
    _expect(isinstance(settings["lz4"], bool), source, "'kvcx.config' lz4 must be true or false")

    codecs_raw = parse_json_field(metadata, "kvcx.codecs", source)
    _expect(isinstance(codecs_raw, dict) and codecs_raw, source, "'kvcx.codecs' must be a non-empty object")
    codecs = {}
    for kind, cfg in codecs_raw.items():
        _expect(isinstance(cfg, dict) and "n_threads" not in cfg, source, f"codec {kind!r} must be a codec object")
        try:
            codecs[kind] = get_codec(cfg)
        except CodecError as exc:
            raise FormatError(f"{source}: codec {kind!r}: {exc}") from None
        need = codecs[kind].format_version
        _expect(int(version) >= int(need), source,
                f"codec {kind!r} ({codecs[kind].describe()}) needs format version {need}, the file says {version}")

    info = parse_json_field(metadata, "kvcx.tensors", source)
    _expect(isinstance(info, dict), source, "'kvcx.tensors' must be an object")
    for name, rec in info.items():
        _expect(isinstance(rec, dict) and set(rec) == {"dtype", "shape", "codec"}, source,
                f"metadata for tensor {name!r} is incomplete or invalid (needs exactly dtype, shape, codec)")
        _expect(rec["dtype"] in ("F16", "BF16", "F32"), source, f"tensor {name!r} has dtype {rec['dtype']!r}; "
                "packed tensors are F16, BF16 or F32")
        shape = rec["shape"]
        _expect(isinstance(shape, list) and len(shape) <= 64 and all(is_int(s) and 1 <= s < 2 ** 62 for s in shape),
                source, f"tensor {name!r} has shape {str(shape)[:60]}; expected a list of positive integers")
        _expect(isinstance(rec["codec"], str) and rec["codec"] in codecs, source,
                f"metadata for tensor {name!r} is incomplete or invalid (codec {str(rec['codec'])[:40]!r} is not "
                f"one of {sorted(codecs)})")
        _expect(not name.endswith(SUFFIXES), source, f"tensor name {name!r} ends with a kvcx-reserved suffix")

    passthrough = parse_json_field(metadata, "kvcx.passthrough", source, required=version == "2")
    passthrough = [] if passthrough is None else passthrough
    _expect(isinstance(passthrough, list) and all(isinstance(n, str) for n in passthrough), source,
            "'kvcx.passthrough' must be a list of tensor names")
    _expect(len(set(passthrough)) == len(passthrough), source, "'kvcx.passthrough' lists a tensor twice")
    for n in passthrough:
        _expect(not n.endswith(SUFFIXES), source, f"pass-through tensor {n!r} has a kvcx-reserved suffix")
        _expect(n not in info, source, f"tensor {n!r} is listed both as packed and as pass-through")

    rope = parse_json_field(metadata, "kvcx.key_rope", source, required=False)
    turned = {}
    if rope is not None:
        _expect(int(version) >= int(KEY_ROPE_VERSION), source,
                f"'kvcx.key_rope' needs format version {KEY_ROPE_VERSION}, the file says {version}")
        _expect(isinstance(rope, dict) and isinstance(rope.get("tensors"), list) and rope["tensors"], source,
                "'kvcx.key_rope' must be an object with inv_freq, offset and a non-empty list of tensors")
        try:
            frame = KeyRope.from_config({k: v for k, v in rope.items() if k != "tensors"})
        except CodecError as exc:
            raise FormatError(f"{source}: 'kvcx.key_rope': {exc}") from None
        for n in rope["tensors"]:
            _expect(isinstance(n, str) and n in info, source,
                    f"'kvcx.key_rope' names tensor {str(n)[:60]!r}, which is not a packed tensor")
            _expect(len(info[n]["shape"]) >= 2 and info[n]["shape"][-1] >= frame.rotary_dims, source,
                    f"'kvcx.key_rope' turns {frame.rotary_dims} dims of tensor {n!r} of shape {info[n]['shape']}")
            turned[n] = frame
    return {"version": version, "config": settings, "codecs": codecs, "tensors": info,
            "passthrough": passthrough, "crc32": metadata.get("kvcx.crc32"), "key_rope": turned}


def packed_tensors(tensors: Dict[str, np.ndarray], metadata: Dict[str, str],
                   source: str = "<packed>") -> Dict[str, Packed]:
    """The :class:`Packed` records of a packed file (codes LZ4-decompressed), every stored tensor checked; the
    records of keys coded before RoPE decode to that frame (:func:`decompress_tensors` turns them back)."""
    return _read_packed(tensors, metadata, source)[1]


def _read_packed(tensors, metadata, source) -> Tuple[dict, Dict[str, Packed]]:
    """(the checked settings, the Packed records) of a packed file."""
    s = read_settings(metadata, source)
    info, codecs = s["tensors"], s["codecs"]
    if s["crc32"] is not None and crc32(tensors, metadata) != s["crc32"]:
        raise FormatError(f"{source}: the file fails its CRC-32 check (kvcx.crc32); it is damaged or was edited: "
                          "copy or create it again")
    # every stored tensor accounted for, and no more
    expected = set(s["passthrough"])
    for name, rec in info.items():
        codec = codecs[rec["codec"]]
        expected |= {f"{name}.kvcx.codes", f"{name}.kvcx.scales"}
        if codec.has_zeros:
            expected.add(f"{name}.kvcx.zeros")
        if codec.sinks and len(rec["shape"]) >= 2:
            expected.add(f"{name}.kvcx.sinks")
    missing = sorted(expected - set(tensors))
    if missing:
        owner = missing[0].split(".kvcx.")[0]
        what = (f"tensor {owner!r} is missing its {missing[0]} entry" if ".kvcx." in missing[0]
                else f"pass-through tensor {missing[0]!r} is missing")
        raise FormatError(f"{source}: {what}; the packed file is damaged")
    extra = sorted(set(tensors) - expected)
    _expect(not extra, source, f"stored tensor {extra[0]!r} is not accounted for by the metadata" if extra else "")
    lz4 = s["config"]["lz4"]
    result = {}
    for name, rec in info.items():
        codec = codecs[rec["codec"]]
        shape, dtype = tuple(rec["shape"]), rec["dtype"]
        try:
            lay = codec.layout(shape, name)
        except CodecError as exc:
            raise FormatError(f"{source}: {exc}") from None
        cfg = codec.packed_config(shape, name)
        codes = tensors[f"{name}.kvcx.codes"]
        _expect(codes.dtype == np.uint8 and codes.ndim == 1, source, f"{name}.kvcx.codes must be a 1-D U8 tensor")
        if lz4:
            codes = lz4_decompress(codes, lay.codes_nbytes, name, source, need_checksum=s["version"] != "1")
        if codes.size != lay.codes_nbytes:
            raise FormatError(f"{source}: tensor {name!r} has {codes.size} code bytes, metadata says "
                              f"{lay.codes_nbytes}")
        scales = tensors[f"{name}.kvcx.scales"]
        zeros = tensors.get(f"{name}.kvcx.zeros") if codec.has_zeros else None
        for part, arr in (("scales", scales), ("zeros", zeros)):
            if arr is None:
                continue
            _expect(arr.dtype == np.float16, source, f"{name}.kvcx.{part} must be F16, got {arr.dtype}")
            _expect(arr.shape == tuple(lay.scale_shape), source,
                    f"{name}.kvcx.{part} has shape {list(arr.shape)}, expected {list(lay.scale_shape)}")
            _expect(bool(np.isfinite(arr).all()), source, f"{name}.kvcx.{part} holds NaN/Inf")
        sinks = None
        if lay.t0:
            sinks = tensors[f"{name}.kvcx.sinks"]
            want = (*shape[:-2], lay.t0, shape[-1])
            _expect(sinks.dtype == numpy_dtype(dtype) and sinks.shape == want, source,
                    f"{name}.kvcx.sinks must be {dtype} {list(want)}, got {sinks.dtype} {list(sinks.shape)}")
        result[name] = Packed(codes=codes, scales=scales, zeros=zeros, sinks=sinks, shape=shape, dtype=dtype,
                              config=cfg)
    return s, result


def decompress_tensors(tensors: Dict[str, np.ndarray], metadata: Dict[str, str], source: str = "<packed>",
                       n_threads: Optional[int] = None,
                       progress: Optional[Callable[[str], None]] = None) -> Dict[str, np.ndarray]:
    """Restore every tensor (names, shapes, dtypes) of a packed file (keys coded before RoPE turned back to
    their positions)."""
    settings, packed = _read_packed(tensors, metadata, source)
    out: Dict[str, np.ndarray] = {}
    for name in settings["passthrough"]:
        out[name] = tensors[name]
    for name, p in packed.items():
        try:
            out[name] = decode(p, name=name, n_threads=n_threads)
        except CodecError as exc:
            raise FormatError(f"{source}: {exc}") from None
        if name in settings["key_rope"]:
            out[name] = settings["key_rope"][name].from_frame(out[name], name)
        if progress:
            progress(name)
    return out


def settings_of(metadata: Dict[str, str]) -> dict:
    """Scheme, sparsity, LZ4 flag and the key/value codec configs recorded in a packed file."""
    return {**json.loads(metadata["kvcx.config"]), "codecs": json.loads(metadata["kvcx.codecs"])}


def original_metadata(metadata: Dict[str, str], source: str = "<packed>") -> Tuple[Optional[Dict[str, str]],
                                                                                     Optional[dict]]:
    """(the input file's own __metadata__, its sidecar) as recorded in a packed file, checked."""
    src = parse_json_field(metadata, "kvcx.source_metadata", source, required=False)
    if src is not None:
        _expect(isinstance(src, dict) and all(isinstance(v, str) for v in src.values()), source,
                "'kvcx.source_metadata' must map strings to strings")
    side = parse_json_field(metadata, "kvcx.sidecar", source, required=False)
    if side is not None:
        _expect(isinstance(side, dict), source, "'kvcx.sidecar' must be an object")
    return src, side
