"""What every codec is: the interface, the packed record it produces, its layout, and the registry.

A codec turns one float tensor into a :class:`Packed` record and back, in the numcodecs style::

    codec = get_codec({"id": "kvcx.int", "bits": 4, "group_size": 64})
    packed = codec.encode(x)                  # x: float16 / bfloat16 / float32 ndarray
    y = codec.decode(packed)                  # same shape and dtype as x
    codec.get_config() == packed.config       # what a file records; from_config() is its inverse
    codec.layout(x.shape)                     # sizes and checks, before any work

New codecs (engine formats, other backends) subclass :class:`Codec` and register with
:func:`register_codec`; everything above the codecs (formats, cache, validation, CLI) finds them by id
through :func:`get_codec`, never by type.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar, Dict, Optional, Tuple, Type

import numpy as np

from kvcx.errors import CodecError

# the id of a config that names none (format version 1 wrote the integer codec's settings alone)
DEFAULT_CODEC_ID = "kvcx.int"
# elements of one tensor at most: byte offsets of a float32 copy must fit an int64 with room to spare
MAX_ELEMENTS = 1 << 56
MAX_SINKS = 2 ** 31 - 1


@dataclass(frozen=True)
class Layout:
    """How a codec sees a tensor of one shape, after every check its kernels rely on.

    ``N`` slabs (the product of the leading dims) of ``S`` tokens (axis -2) of ``D`` values (axis -1);
    the first ``t0`` tokens of each slab are kept exact (sinks). ``codes_nbytes`` bytes of codes and
    ``scale_shape`` FP16 parameters (scales, and zero points of the same shape where the codec has them).
    ``partial_group``: values (or tokens) in a last group that is not full, 0 when every group is full.
    ``groups`` / ``budget``: token groups per slab
    and bits per slab over its channels (per-channel-width codecs only, else 0)."""

    shape: Tuple[int, ...]
    N: int
    S: int
    D: int
    t0: int
    codes_nbytes: int
    scale_shape: Tuple[int, ...]
    partial_group: int
    groups: int = 0
    budget: int = 0

    @property
    def numel(self) -> int:
        return self.N * self.S * self.D


@dataclass
class Packed:
    """One encoded tensor: packed codes, FP16 scales (+ zero points), exact sink tokens."""

    codes: np.ndarray                 # uint8, 1-D
    scales: np.ndarray                # float16
    zeros: Optional[np.ndarray]       # float16 (codecs with zero points) or None
    sinks: Optional[np.ndarray]       # original dtype, [..., sinks, D] or None
    shape: tuple
    dtype: str                        # 'F16' | 'BF16' | 'F32'
    config: dict                      # codec config actually used for this tensor
    meta: dict = field(default_factory=dict)  # layout facts (partial group)

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        n = self.codes.nbytes + self.scales.nbytes
        n += self.zeros.nbytes if self.zeros is not None else 0
        n += self.sinks.nbytes if self.sinks is not None else 0
        return int(n)

    @property
    def bits_per_value(self) -> float:
        return 8.0 * self.nbytes / max(1, self.numel)


def view3(shape: tuple) -> tuple:
    """(N, S, D): slabs, tokens, values per token (the last axis); Python ints, no overflow."""
    if len(shape) == 0:
        return 1, 1, 1
    if len(shape) == 1:
        return 1, 1, int(shape[0])
    return math.prod(int(s) for s in shape[:-2]), int(shape[-2]), int(shape[-1])


def check_shape(shape: tuple, name: str) -> None:
    """CodecError unless ``shape`` is non-empty, made of non-negative integers, and not absurdly large."""
    if any(isinstance(s, bool) or not isinstance(s, (int, np.integer)) or s < 0 for s in shape):
        raise CodecError(f"tensor {name!r}: shape {list(shape)} must be a list of non-negative integers")
    if any(s == 0 for s in shape):
        raise CodecError(f"tensor {name!r} is empty (shape {list(shape)}); there is nothing to compress")
    if math.prod(int(s) for s in shape) > MAX_ELEMENTS:
        raise CodecError(f"tensor {name!r}: shape {list(shape)} has more than 2**56 elements; split it")


def check_sinks(sinks) -> int:
    from kvcx.codecs.dtypes import is_int

    if not is_int(sinks) or not 0 <= sinks <= MAX_SINKS:
        raise CodecError(f"sinks must be a non-negative integer up to {MAX_SINKS} (tokens kept exact), got {sinks!r}")
    return int(sinks)


class Codec:
    """The interface of a codec (subclass it and :func:`register_codec` the subclass).

    A subclass sets ``codec_id`` and ``settings`` (the constructor's keyword arguments that
    :meth:`get_config` records), and implements :meth:`layout`, :meth:`encode`, :meth:`decode` and
    :meth:`bits_per_value`. Equality, hashing, ``repr`` (eval-able), the config round trip and
    :meth:`with_threads` come from here. ``n_threads`` is how many threads the codec runs on; it is not
    part of the config (a file decodes the same on any machine), nor is ``backend`` (where torch tensors are
    worked on: :mod:`kvcx.codecs.backends`; the bytes are the same on every backend).

    Facts other layers read instead of testing types: :attr:`has_zeros`, ``sinks`` (exact leading tokens),
    ``format_version`` (the lowest packed-file version that can hold its records), ``takes_weights`` (its
    encoder takes per-channel weights), :attr:`token_block` (tokens encoded together so every group is full).
    """

    codec_id: ClassVar[str] = ""
    settings: ClassVar[Tuple[str, ...]] = ()
    format_version: ClassVar[str] = "1"
    takes_weights: ClassVar[bool] = False
    n_threads: Optional[int] = None
    backend: Optional[str] = None   # where torch tensors are worked on (kvcx.codecs.backends); None: by device
    sinks: int = 0              # leading tokens kept exact (records carry them as ``sinks``)

    @property
    def has_zeros(self) -> bool:
        """Whether this codec's records carry zero points (``Packed.zeros``)."""
        return False

    # -- config -------------------------------------------------------------------------------
    def get_config(self) -> dict:
        """The codec's settings with its ``id`` (what a packed file records)."""
        return {"id": self.codec_id, **{k: getattr(self, k) for k in self.settings}}

    @classmethod
    def from_config(cls, config: dict) -> "Codec":
        if not isinstance(config, dict):
            raise CodecError(f"a codec config must be an object, got {type(config).__name__}")
        config = dict(config)
        codec_id = config.pop("id", cls.codec_id)
        if codec_id != cls.codec_id:
            raise CodecError(f"codec id {codec_id!r} is not {cls.codec_id!r}; this file was not written by kvcx")
        known = set(cls.settings) | {"n_threads", "backend"}
        unknown = set(config) - known
        if unknown:
            raise CodecError(f"unknown codec settings {sorted(unknown)}; known: {sorted(known)}")
        return cls(**config)

    def replace(self, **settings) -> "Codec":
        """The same codec with ``settings`` changed (its own, ``n_threads``, ``backend``); the others kept."""
        run = {k: v for k, v in (("n_threads", self.n_threads), ("backend", self.backend)) if v is not None}
        return type(self).from_config({**self.get_config(), **run, **settings})

    def with_threads(self, n_threads: Optional[int]) -> "Codec":
        """The same codec running on ``n_threads`` threads (on the same backend)."""
        return self.replace(n_threads=n_threads)

    def with_backend(self, backend: Optional[str]) -> "Codec":
        """The same codec working torch tensors on ``backend`` (None: by the tensor's device)."""
        return self.replace(backend=backend)

    def __eq__(self, other) -> bool:
        return type(other) is type(self) and self.get_config() == other.get_config()

    def __hash__(self):
        return hash(tuple(sorted(self.get_config().items())))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={getattr(self, k)!r}' for k in self.settings)})"

    # -- geometry -------------------------------------------------------------------------------
    def layout(self, shape: tuple, name: str = "tensor") -> Layout:
        """The :class:`Layout` of a tensor of this shape, or CodecError saying why the codec cannot take it."""
        raise NotImplementedError

    def supports(self, shape: tuple) -> bool:
        """Whether this codec can encode a tensor of this shape."""
        try:
            self.layout(tuple(shape))
        except CodecError:
            return False
        return True

    def codes_nbytes(self, shape: tuple, name: str = "tensor") -> int:
        """Bytes of packed codes for a tensor of this shape."""
        return self.layout(tuple(shape), name).codes_nbytes

    def packed_config(self, shape: tuple, name: str = "tensor") -> dict:
        """The config recorded for a tensor of this shape (sinks capped to its token count)."""
        cfg = self.get_config()
        if "sinks" in cfg:
            cfg["sinks"] = self.layout(tuple(shape), name).t0
        return cfg

    @property
    def token_block(self) -> int:
        """Tokens whose multiples fill every group (1 when groups never span tokens)."""
        return 1

    def fallback(self) -> "Codec":
        """A codec of these settings for tensors this one cannot take (any shape); this one by default."""
        return self

    def bits_per_value(self) -> float:
        """Nominal bits per value (codes and per-group parameters, without sinks or partial groups)."""
        raise NotImplementedError

    def describe(self) -> str:
        """A short description for reports."""
        return repr(self)

    # -- the work -------------------------------------------------------------------------------
    def encode(self, x, out: Optional[Packed] = None, *, name: str = "tensor",
               weights: Optional[np.ndarray] = None) -> Packed:
        """Encode ``x``. ``out``: a Packed of this codec and shape whose buffers are written (and returned);
        ``weights``: per-channel weights for codecs that take them (``takes_weights``)."""
        raise NotImplementedError

    def decode(self, packed: Packed, out: Optional[np.ndarray] = None, *, name: str = "tensor",
               token_offset: int = 0) -> np.ndarray:
        """Decode ``packed``. ``out`` (optional) has its shape and dtype, or is longer on axis -2: the tensor
        is then written at ``out[..., token_offset:token_offset + S, :]`` (a KV cache assembled from chunks)."""
        raise NotImplementedError

    def decoder(self, packed: Packed, name: str = "tensor"):
        """``run(out=None, token_offset=0)``: ``packed`` decoded as :meth:`decode` does (into ``out`` at
        ``token_offset``) at each call, for a record decoded again and again (a cache's store at every step). On a
        device backend its checks are made once, now, and a call launches its kernels and reads nothing back to
        the host; elsewhere each call is :meth:`decode`."""
        from kvcx.codecs.backends import backend_for

        backend = backend_for(self, packed.codes, name)
        if backend is not None:
            lay = self.layout(tuple(packed.shape), name)
            check_recorded_sinks(packed, lay.t0, lay.shape, name)
            return backend.decoder(self, lay, packed, name)

        def run(out=None, token_offset: int = 0):
            return self.decode(packed, out, name=name, token_offset=token_offset)
        return run


_REGISTRY: Dict[str, Type[Codec]] = {}


def register_codec(cls: Type[Codec]) -> Type[Codec]:
    """Register a codec class under its ``codec_id`` (usable as a class decorator)."""
    if not (isinstance(cls, type) and issubclass(cls, Codec)) or not cls.codec_id:
        raise CodecError(f"register_codec takes a Codec subclass with a codec_id, got {cls!r}")
    known = _REGISTRY.get(cls.codec_id)
    if known is not None and known is not cls:
        raise CodecError(f"a codec with id {cls.codec_id!r} is already registered ({known.__name__})")
    _REGISTRY[cls.codec_id] = cls
    return cls


def registered_codecs() -> Tuple[str, ...]:
    """The ids of every registered codec."""
    return tuple(sorted(_REGISTRY))


def get_codec(config: dict, n_threads: Optional[int] = None) -> Codec:
    """The codec a config describes, found by its ``id`` (a config without one is a version-1 integer codec)."""
    if not isinstance(config, dict):
        raise CodecError(f"a codec config must be an object, got {type(config).__name__}")
    codec_id = config.get("id", DEFAULT_CODEC_ID)
    cls = _REGISTRY.get(codec_id) if isinstance(codec_id, str) else None
    if cls is None:
        raise CodecError(f"codec id {str(codec_id)[:40]!r} is not one kvcx knows ({', '.join(registered_codecs())}); "
                         "this file was not written by kvcx, or by a newer kvcx: upgrade kvcx")
    return cls.from_config({**config, "n_threads": n_threads} if n_threads is not None else config)


def decode(packed: Packed, out: Optional[np.ndarray] = None, *, name: str = "tensor",
           n_threads: Optional[int] = None, token_offset: int = 0) -> np.ndarray:
    """Decode a Packed with the codec its config records."""
    return get_codec(packed.config, n_threads).decode(packed, out, name=name, token_offset=token_offset)


def decode_out(packed: Packed, out: Optional[np.ndarray], token_offset: int, name: str) -> tuple:
    """(out, its token count): a new array, or the caller's ``out`` after every check (same shape and
    dtype, or longer on axis -2 with ``token_offset``)."""
    from kvcx.codecs.dtypes import numpy_dtype

    shape = tuple(packed.shape)
    dtype = numpy_dtype(packed.dtype)
    if out is None:
        if token_offset:
            raise CodecError("token_offset needs an out= array")
        return np.empty(shape, dtype=dtype), (shape[-2] if len(shape) >= 2 else 1)
    ok = (isinstance(out, np.ndarray) and out.dtype == dtype and out.ndim == len(shape)
          and out.flags.c_contiguous and out.flags.writeable)
    if ok and token_offset == 0 and tuple(out.shape) == shape:
        return out, (shape[-2] if len(shape) >= 2 else 1)
    if ok and len(shape) >= 2 and out.shape[:-2] == shape[:-2] and out.shape[-1] == shape[-1] \
            and 0 <= token_offset and token_offset + shape[-2] <= out.shape[-2]:
        return out, int(out.shape[-2])
    got = f"{out.dtype} {list(out.shape)}" if isinstance(out, np.ndarray) else type(out).__name__
    raise CodecError(f"tensor {name!r}: out must be a writeable C-contiguous {dtype} array of shape "
                     f"{list(shape)} (or longer on axis -2 with token_offset), got {got}")


def check_sinks_finite(packed: Packed, t0: int, name: str) -> None:
    """CodecError unless the record's exact sink tokens are all finite (an encoder refuses non-finite ones); a
    record's torch tensors are checked where they are."""
    from kvcx.codecs.backends import is_tensor

    sinks = packed.sinks
    finite = sinks is None or (bool(sinks.isfinite().all()) if is_tensor(sinks) else
                               np.isfinite(np.asarray(sinks, dtype=np.float32)).all())
    if t0 and not finite:
        raise CodecError(f"tensor {name!r}: its exact sink tokens hold NaN/Inf, which no kvcx encoder writes; the "
                         "data is damaged: encode it again")


def write_sinks(x3: np.ndarray, t0: int, shape: tuple, out: Optional[Packed]) -> Optional[np.ndarray]:
    """The first ``t0`` tokens of every slab of ``x3`` (N, S, D), shaped [..., t0, D]: written into
    ``out.sinks`` when it is a buffer of that shape and dtype (a section of a chunk), else a new array."""
    if not t0:
        return None
    want = (*shape[:-2], t0, shape[-1])
    dst = out.sinks if out is not None else None
    if isinstance(dst, np.ndarray) and dst.shape == want and dst.dtype == x3.dtype and dst.flags.writeable:
        dst.reshape(x3.shape[0], t0, x3.shape[2])[...] = x3[:, :t0, :]
        return dst
    return np.ascontiguousarray(x3[:, :t0, :]).reshape(want)


def restore_sinks(packed: Packed, out: np.ndarray, out_S: int, token_offset: int, N: int, t0: int, D: int,
                  name: str) -> None:
    """Write the record's ``t0`` exact sink tokens into ``out`` (N slabs of ``out_S`` tokens, the tensor's token 0 at
    ``token_offset``); CodecError when they are recorded but missing."""
    if not t0:
        return
    if packed.sinks is None or packed.sinks.size != N * t0 * D:
        raise CodecError(f"tensor {name!r}: {t0} exact sink tokens are recorded but their values are missing")
    out.reshape(N, out_S, D)[:, token_offset:token_offset + t0, :] = \
        np.asarray(packed.sinks).astype(out.dtype, copy=False).reshape(N, t0, D)


def check_recorded_sinks(packed: Packed, t0: int, shape: tuple, name: str) -> None:
    """CodecError unless the record's ``sinks`` setting gives the ``t0`` its shape does."""
    if t0 != packed.config.get("sinks", 0):
        raise CodecError(f"tensor {name!r}: recorded sinks {packed.config.get('sinks')} do not fit shape "
                         f"{list(shape)}")


def out_buffers(out, shapes: dict, name: str, x_shape) -> dict:
    """The caller's Packed buffers when they fit (section views of a file), else new ones."""
    if out is None:
        return {k: np.empty(s, dtype=d) for k, (s, d) in shapes.items()}
    got = {}
    for k, (s, d) in shapes.items():
        a = getattr(out, k, None)
        if not (isinstance(a, np.ndarray) and a.shape == tuple(s) and a.dtype == d and a.flags.c_contiguous
                and a.flags.writeable):
            raise CodecError(f"tensor {name!r}: out must be a Packed from encoding a tensor of shape "
                             f"{list(x_shape)} with this codec ({k}: {d.__name__ if hasattr(d, '__name__') else d} "
                             f"{list(s)})")
        got[k] = a
    return got


def finish_packed(out, fields: dict) -> Packed:
    """A new Packed of these fields, or the caller's ``out`` updated with them (the buffers it lent)."""
    if out is None:
        return Packed(**fields)
    out.__dict__.update(fields)
    return out
