"""A pure-Python safetensors reader/writer (``json`` + NumPy), strict about headers.

Same verbs as Hugging Face's ``safetensors.numpy``: ``save``, ``save_file``,
``load``, ``load_file``. Files are read with ``preadv``, not memory-mapped, so a file truncated by
another process while it is read is an error, not a SIGBUS; :class:`SafeFile` reads a tensor when it
is asked for, and ``SafeFile.tensors()`` is a mapping that holds none of them.

Layout: 8-byte little-endian header length N, N bytes of UTF-8 JSON (padded
with spaces to a multiple of 8), then the data section. Every header entry is
``{"dtype", "shape", "data_offsets": [begin, end]}`` relative to the data
section; entries are back to back, in the file, and the data ends exactly at
the last one. ``__metadata__`` is an optional str -> str map.
"""
from __future__ import annotations

import json
import os
from collections.abc import Mapping
from contextlib import contextmanager
from typing import Dict, Iterator, Optional

import numpy as np

from kvcx.codecs.dtypes import bfloat16
from kvcx.errors import FormatError
from kvcx.formats.atomic import OutputSet, open_regular, write_bytes_to
from kvcx.formats.jsonio import check_text, no_duplicate_keys

MAX_HEADER_SIZE = 100_000_000  # the cap Hugging Face's implementation uses

_TYPES = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": None,   # ml_dtypes' bfloat16, imported where a file holds one (_numpy_dtype)
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"),
    "U32": np.dtype("<u4"),
    "U16": np.dtype("<u2"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}
# order used when writing, as Hugging Face's implementation does: dtype rank (its Dtype enum order)
# descending, then name. This makes our files byte-identical to theirs.
_RANK = {name: i for i, name in enumerate(
    ["BOOL", "U8", "I8", "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "F64", "I64", "U64"])}


def _numpy_dtype(name: str) -> Optional[np.dtype]:
    """The NumPy dtype of a safetensors dtype name (None: BF16 without ml_dtypes)."""
    return bfloat16() if name == "BF16" else _TYPES[name]


def dtype_to_name(dtype: np.dtype, key: str = "tensor") -> str:
    dtype = np.dtype(dtype)
    if dtype.byteorder == ">":
        dtype = dtype.newbyteorder("<")
    if dtype.name == "bfloat16" and dtype == bfloat16():
        return "BF16"
    for name, dt in _TYPES.items():
        if dt is not None and dt == dtype:
            return name
    raise FormatError(f"tensor {key!r} has dtype {dtype}, which safetensors cannot store; "
                      f"supported: {', '.join(_TYPES)}")


def parse_header(prefix: bytes, file_size: int, source: str = "<bytes>"):
    """Validate the header; returns (entries, metadata, data_start).

    ``prefix`` must hold at least the first ``8 + N`` bytes (or all of a short file).
    """
    if file_size < 8:
        raise FormatError(f"{source}: not a safetensors file (only {file_size} bytes; the 8-byte header length "
                          "is missing)")
    n = int.from_bytes(prefix[:8], "little")
    if n > MAX_HEADER_SIZE:
        raise FormatError(f"{source}: header length {n} exceeds the {MAX_HEADER_SIZE}-byte cap; "
                          "the file is corrupt or not safetensors")
    if 8 + n > file_size:
        raise FormatError(f"{source}: truncated: the header claims {n} bytes but the file has {file_size - 8} "
                          "after the length field")
    raw = prefix[8:8 + n]
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise FormatError(f"{source}: header is not valid UTF-8; the file is corrupt or not safetensors") from None
    if not text.startswith("{"):
        raise FormatError(f"{source}: header must be a JSON object starting with '{{'; not a safetensors file")
    try:
        header = json.loads(text, object_pairs_hook=no_duplicate_keys)
    except FormatError as exc:
        raise FormatError(f"{source}: {exc} in the header") from None
    except (ValueError, RecursionError) as exc:
        raise FormatError(f"{source}: header is not valid JSON ({str(exc)[:80]})") from None
    if not isinstance(header, dict):
        raise FormatError(f"{source}: header must be a JSON object")
    check_text(header, f"{source}: header")   # names and metadata kvcx could not write back are refused here
    metadata = header.pop("__metadata__", None)
    if metadata is not None:
        if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                      for k, v in metadata.items()):
            raise FormatError(f"{source}: __metadata__ must map strings to strings")
    data_start = 8 + n
    data_len = file_size - data_start
    entries = {}
    for key, info in header.items():
        if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            raise FormatError(f"{source}: key {key!r} is invalid, expected an object with exactly dtype, shape "
                              f"and data_offsets, got {str(info)[:80]}")
        dtype = info["dtype"]
        if not isinstance(dtype, str) or dtype not in _TYPES or _numpy_dtype(dtype) is None:
            raise FormatError(f"{source}: key {key!r} has unknown dtype {dtype!r}; supported: {', '.join(_TYPES)}")
        shape = info["shape"]
        if not isinstance(shape, list) or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0
                                                  for s in shape):
            raise FormatError(f"{source}: key {key!r} has invalid shape {shape!r}; expected a list of "
                              "non-negative integers")
        offs = info["data_offsets"]
        if (not isinstance(offs, list) or len(offs) != 2
                or not all(isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in offs)
                or offs[0] > offs[1]):
            raise FormatError(f"{source}: key {key!r} has invalid data_offsets {offs!r}; expected [begin, end] "
                              "with 0 <= begin <= end")
        numel = 1
        for s in shape:
            numel *= s  # Python ints: no overflow
        nbytes = numel * _numpy_dtype(dtype).itemsize
        if offs[1] - offs[0] != nbytes:
            raise FormatError(f"{source}: key {key!r} is invalid: shape {shape} of {dtype} needs {nbytes} bytes "
                              f"but data_offsets span {offs[1] - offs[0]}")
        entries[key] = (dtype, tuple(shape), offs[0], offs[1])
    end = 0
    for key, (_, _, begin, stop) in sorted(entries.items(), key=lambda kv: (kv[1][2], kv[1][3])):
        if begin != end:
            what = "overlaps the previous tensor" if begin < end else f"leaves a gap after byte {end}"
            raise FormatError(f"{source}: key {key!r} at data offset {begin} {what}; offsets must be back to back")
        end = stop
    if end != data_len:
        raise FormatError(f"{source}: the data section has {data_len} bytes but the tensors cover {end}; "
                          "the file is truncated or has trailing bytes")
    return entries, metadata or {}, data_start


def _as_array(buf, dtype: str, shape: tuple, begin: int, end: int, start: int) -> np.ndarray:
    dt = _numpy_dtype(dtype)
    count = (end - begin) // dt.itemsize
    return np.frombuffer(buf, dtype=dt, count=count, offset=start + begin).reshape(shape)


class SafeFile:
    """A safetensors file opened for reading (the header parsed at once, tensors read when asked for); use
    as a context manager or call close().

    Tensors are read into memory (``preadv``), not memory-mapped: a file that another process truncates or
    rewrites while kvcx reads it is a :class:`FormatError` naming it, never a SIGBUS. Each read checks that
    the file is still the one opened (size, modification time, inode)."""

    def __init__(self, path):
        self.path = os.fspath(path)
        self._fh = open_regular(self.path, ".safetensors file")
        try:
            st = os.fstat(self._fh.fileno())
            self._identity = (st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev)
            size = st.st_size
            head = self._fh.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else 0
            prefix = head + (self._fh.read(n) if len(head) == 8 and n <= MAX_HEADER_SIZE and 8 + n <= size else b"")
        except OSError as exc:
            self.close()
            raise FormatError(f"{self.path}: cannot read ({exc.strerror or exc})") from None
        try:
            self.entries, self.metadata, self._start = parse_header(prefix, size, self.path)
        except FormatError:
            self.close()
            raise
        self._check_unchanged()

    def keys(self):
        return list(self.entries)

    def _check_unchanged(self) -> None:
        st = os.fstat(self._fh.fileno())
        if (st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev) != self._identity:
            raise FormatError(f"{self.path}: the file changed while kvcx read it (another process wrote or truncated "
                              "it); run again once it is complete")

    def get_tensor(self, key: str) -> np.ndarray:
        """The tensor ``key``, read now into a new read-only array."""
        if key not in self.entries:
            raise FormatError(f"{self.path}: no tensor named {key!r}; it has {', '.join(list(self.entries)[:8])}")
        if self._fh is None:
            raise FormatError(f"{self.path}: the file is closed; open it again")
        dtype, shape, begin, end = self.entries[key]
        out = np.empty(end - begin, dtype=np.uint8)
        view, done, fd = memoryview(out), 0, self._fh.fileno()
        while done < out.size:
            try:
                got = os.preadv(fd, [view[done:]], self._start + begin + done)
            except OSError as exc:
                raise FormatError(f"{self.path}: cannot read tensor {key!r} ({exc.strerror or exc})") from None
            if got == 0:
                raise FormatError(f"{self.path}: the file ended while kvcx read tensor {key!r} (another process "
                                  "truncated it?); run again once it is complete")
            done += got
        self._check_unchanged()
        arr = out.view(_numpy_dtype(dtype)).reshape(shape)
        arr.setflags(write=False)
        return arr

    def shape_and_dtype(self, key: str) -> tuple:
        """(shape, NumPy dtype) of tensor ``key``, from the header (nothing read)."""
        dtype, shape, _, _ = self.entries[key]
        return shape, _numpy_dtype(dtype)

    def tensors(self) -> "Tensors":
        """Every tensor, each read when it is looked up (a Mapping: memory holds one tensor at a time)."""
        return Tensors(self)

    def close(self):
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        fh = getattr(self, "_fh", None)
        if fh is not None:
            fh.close()


class Tensors(Mapping):
    """The tensors of a :class:`SafeFile` as a read-only mapping that reads a tensor when it is looked up
    (each lookup reads again: a caller that needs one twice keeps it)."""

    def __init__(self, f: SafeFile):
        self._f = f

    def __getitem__(self, key):
        if key not in self._f.entries:
            raise KeyError(key)
        return self._f.get_tensor(key)

    def __iter__(self):
        return iter(self._f.entries)

    def __len__(self):
        return len(self._f.entries)


def load(data: bytes) -> Dict[str, np.ndarray]:
    """Tensors from safetensors bytes (arrays are read-only views of ``data``)."""
    entries, _, start = parse_header(data, len(data))
    return {k: _as_array(data, d, s, b, e, start) for k, (d, s, b, e) in entries.items()}


def load_with_metadata(data: bytes):
    entries, metadata, start = parse_header(data, len(data))
    return {k: _as_array(data, d, s, b, e, start) for k, (d, s, b, e) in entries.items()}, metadata


def load_file(path) -> Dict[str, np.ndarray]:
    """Tensors of a file (read-only arrays)."""
    with SafeFile(path) as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def read_metadata(path) -> Dict[str, str]:
    with SafeFile(path) as f:
        return f.metadata


def _header_and_order(tensors: Dict[str, np.ndarray], metadata: Optional[Dict[str, str]]):
    if not isinstance(tensors, dict):
        raise FormatError(f"tensors must be a dict of name -> array, got {type(tensors).__name__}")
    if metadata is not None and not (isinstance(metadata, dict) and all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())):
        raise FormatError("metadata must map strings to strings")
    check_text(metadata or {}, "metadata")
    check_text(list(tensors), "tensor names")
    arrays = {}
    for k, v in tensors.items():
        if not isinstance(k, str) or k == "__metadata__":
            raise FormatError(f"invalid tensor name {k!r}; names are strings other than '__metadata__'")
        a = np.asarray(v)
        if not a.flags.c_contiguous:
            a = np.ascontiguousarray(a).reshape(a.shape)  # ascontiguousarray alone turns 0-d into 1-d
        arrays[k] = (dtype_to_name(a.dtype, k), a)
    order = sorted(arrays, key=lambda k: (-_RANK[arrays[k][0]], k))
    header = {}
    if metadata:
        # keys in byte order: deterministic bytes (Hugging Face's writer uses its map's order)
        header["__metadata__"] = {k: metadata[k] for k in sorted(metadata)}
    off = 0
    for k in order:
        name, a = arrays[k]
        header[k] = {"dtype": name, "shape": list(a.shape), "data_offsets": [off, off + a.nbytes]}
        off += a.nbytes
    hb = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    hb += b" " * (-len(hb) % 8)
    return hb, [arrays[k][1] for k in order]


def serialized_size(tensors: Dict[str, np.ndarray], metadata: Optional[Dict[str, str]] = None) -> int:
    """Bytes ``save`` would produce, without building them."""
    hb, arrays = _header_and_order(tensors, metadata)
    return 8 + len(hb) + sum(a.nbytes for a in arrays)


def save(tensors: Dict[str, np.ndarray], metadata: Optional[Dict[str, str]] = None) -> bytes:
    import io

    buf = io.BytesIO()
    for c in _chunks(*_header_and_order(tensors, metadata)):
        buf.write(c)
    return buf.getvalue()


@contextmanager
def atomic_output(path) -> Iterator[str]:
    """Yield a temporary path beside ``path``; it replaces ``path`` only if the block succeeds
    (see :class:`kvcx.formats.atomic.OutputSet`: mode as ``open()`` gives, signals cleaned up)."""
    with OutputSet([path]) as tmp:
        yield tmp[os.fspath(path)]


def write_to(tmp: str, target, tensors: Dict[str, np.ndarray], metadata: Optional[Dict[str, str]] = None) -> None:
    """Write a safetensors file to the temporary path ``tmp`` of ``target`` (part of an OutputSet)."""
    hb, arrays = _header_and_order(tensors, metadata)
    write_bytes_to(tmp, os.fspath(target), _chunks(hb, arrays))


def _chunks(hb, arrays):
    yield len(hb).to_bytes(8, "little")
    yield hb
    for a in arrays:
        if a.dtype.byteorder == ">":
            a = a.astype(a.dtype.newbyteorder("<"))
        yield memoryview(a.reshape(-1).view(np.uint8))


def save_file(tensors: Dict[str, np.ndarray], path, metadata: Optional[Dict[str, str]] = None) -> None:
    """Write a safetensors file atomically (temp file + rename)."""
    hb, arrays = _header_and_order(tensors, metadata)  # validate before touching the disk
    with atomic_output(path) as tmp:
        write_bytes_to(tmp, os.fspath(path), _chunks(hb, arrays))
