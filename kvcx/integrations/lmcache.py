"""kvcx as an LMCache serde: KV chunks compressed by the Cython kernels on their way to a shared store.

    import kvcx.integrations.lmcache as kvcx_lmcache
    kvcx_lmcache.register()          # once per process, before LMCache builds its L2 adapters

then, in an L2 adapter's config::

    {"type": "fs", "base_path": "/cache",
     "serde": {"type": "kvcx", "scheme": "kvcx", "group_size": 64, "head_dim": 64}}

Options (all optional but ``head_dim`` when the model's head size is not 64): ``scheme`` (kvcx,
reference, symmetric, asymmetric, kivi), ``group_size``, ``bits``, ``sinks``, ``rotate``, ``head_dim``,
``threads`` (OpenMP threads per chunk; default all cores), ``max_workers`` (LMCache's serde
worker threads, default 1) and ``backend`` (``"triton"`` or ``"cpu"``; default: by where the chunk lives).

Layouts (:mod:`kvcx.formats.layouts`): a 4-D chunk is LMCache's KV_2LTD. A 3-D chunk is a single plane whose
shape does not say what it holds, so the config says it: ``"layout": "vllm_cpu"`` with ``"block_size"`` (vLLM's
``--block-size``, 128 by default on CPU) for vLLM's CPU attention, which keeps K and V in one tensor
(``"isa"``: ``auto``, as vLLM picks it on this host, or ``vec``, ``vec16``, ``amx``), or ``"layout": "mla"`` for
an MLA latent plane. Without it a 3-D chunk is refused with an error naming these options (LMCache logs a
failed store; nothing is written). The chunk records its layout, and is only read back into the same one::

    {"type": "fs", "base_path": "/cache",
     "serde": {"type": "kvcx", "head_dim": 64, "layout": "vllm_cpu", "block_size": 128}}

A chunk that lives on the GPU (a CUDA memory object) is encoded and decoded there by the Triton kernels:
only its packed sections cross to the host buffer (or back), never the uncompressed chunk, and the bytes
are the ones the CPU kernels write, so a chunk written on the GPU decodes on the CPU and back, bit for bit.

Each chunk is bound to the store key LMCache writes it under: a valid chunk read under another key (a
mix-up in the store no checksum sees) fails the load instead of returning another chunk's tensor.

The pair is pure and synchronous, as LMCache's serdes are: ``serialize`` views the source memory
object's bytes as a NumPy array (no copy) and runs the kernels from it straight into the destination
buffer; ``deserialize`` decodes straight into the destination object. The size is exact
(``estimate_serialized_size``), as LMCache's FS and RESP adapters require. Every chunk carries a
magic, a wire version, its shape, dtype and codec settings and a CRC-32 (see :mod:`kvcx.formats.chunk`), so
it always decodes with what wrote it, and a foreign or damaged payload is refused with an error.

Needs LMCache (``>=0.5.6,<0.6``, the tested range) and torch (``pip install kvcx[lmcache]``; ``kvcx[gpu]`` for
the Triton kernels); torch is used only to view memory objects' buffers, never for math.
"""
from __future__ import annotations

import json
from typing import Iterable, List, Optional

import numpy as np

from kvcx.codecs.dtypes import BFLOAT16, is_int
from kvcx.codecs.kvconfig import SCHEME_NAMES, KVConfig
from kvcx.errors import KvcxError
from kvcx.formats.chunk import ChunkCodec
from kvcx.formats.layouts import plane_layout

try:
    import torch
    from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
    from lmcache.v1.distributed.serde.async_processor import AsyncSerdeProcessor
    from lmcache.v1.distributed.serde.base import Deserializer, SerdeProcessor, Serializer
    from lmcache.v1.distributed.serde.factory import get_registered_serde_types, register_serde_factory
    from lmcache.v1.memory_management import MemoryObj
except ImportError as exc:  # pragma: no cover - exercised without the extra installed
    raise KvcxError(f"kvcx.integrations.lmcache needs LMCache and torch ({exc.name} is missing): "
                    "pip install 'lmcache>=0.5.6,<0.6' torch (or kvcx[lmcache])") from None

SERDE_NAME = "kvcx"
_OPTIONS = {"scheme", "group_size", "bits", "sinks", "rotate", "head_dim", "threads", "max_workers", "backend",
            "layout", "block_size", "isa"}
_TORCH_TO_NUMPY = {torch.float32: np.dtype(np.float32), torch.float16: np.dtype(np.float16),
                   torch.bfloat16: BFLOAT16}


class KvcxSerdeError(KvcxError):
    """A chunk, buffer or serde option LMCache handed to kvcx that it cannot take."""


def _int_option(opts: dict, name: str, lo: int, hi: int, default=None):
    v = opts.get(name, default)
    if v is None:
        return None
    if not is_int(v) or not lo <= v <= hi:
        raise KvcxSerdeError(f"serde option {name!r} must be an integer from {lo} to {hi}, got {v!r}")
    return v


def chunk_codec_from_options(options: dict) -> tuple:
    """(ChunkCodec, max_workers) from a serde config's options (``"type"`` already removed)."""
    if not isinstance(options, dict):
        raise KvcxSerdeError(f"the kvcx serde options must be an object, got {type(options).__name__}")
    unknown = sorted(set(options) - _OPTIONS - {"type"})
    if unknown:
        raise KvcxSerdeError(f"unknown kvcx serde options {unknown}; known: {sorted(_OPTIONS)}")
    scheme = options.get("scheme", "kvcx")
    if scheme not in SCHEME_NAMES:
        raise KvcxSerdeError(f"serde option 'scheme' must be one of {', '.join(SCHEME_NAMES)}, got {scheme!r}")
    rotate = options.get("rotate")
    if rotate is not None and not isinstance(rotate, bool):
        raise KvcxSerdeError(f"serde option 'rotate' must be true or false, got {rotate!r}")
    try:
        cfg = KVConfig.from_scheme(scheme, group_size=_int_option(options, "group_size", 1, 1 << 16),
                                   bits=_int_option(options, "bits", 1, 64), sinks=_int_option(options, "sinks", 0, 2 ** 31 - 1),
                                   rotate=rotate, n_threads=_int_option(options, "threads", 1, 1024))
        cfg = cfg.with_backend(options.get("backend"))
        plane = plane_layout(options.get("layout"), _int_option(options, "block_size", 1, 65535), options.get("isa"),
                             host_amx=host_has_amx())
        codec = ChunkCodec(cfg, head_dim=_int_option(options, "head_dim", 1, 65535, default=64), plane_layout=plane)
    except KvcxError as exc:
        raise KvcxSerdeError(f"kvcx serde options: {exc}") from None
    return codec, _int_option(options, "max_workers", 1, 64, default=1)


def host_has_amx() -> bool:
    """Whether this CPU has AMX tiles, as vLLM asks it when it picks its CPU attention kernel."""
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    try:
        return bool(probe()) if probe is not None else False
    except RuntimeError:
        return False


def _layout_of(shapes, dtypes, where: str):
    if len(shapes) != 1 or len(dtypes) != 1:
        raise KvcxSerdeError(f"{where}: the kvcx serde takes single-tensor chunks (KV_2LTD or one plane), got "
                             f"{len(shapes)} tensors")
    if dtypes[0] == torch.bfloat16 and BFLOAT16 is None:
        raise KvcxSerdeError(f"{where}: a bfloat16 chunk needs the ml_dtypes package, which kvcx depends on: "
                             "pip install ml_dtypes (in the environment of LMCache's server)")
    if dtypes[0] not in _TORCH_TO_NUMPY:
        raise KvcxSerdeError(f"{where}: dtype {dtypes[0]} is not bfloat16, float16 or float32")
    return tuple(int(s) for s in shapes[0]), _TORCH_TO_NUMPY[dtypes[0]]


def _bytes_of(obj: MemoryObj, where: str) -> np.ndarray:
    """The memory object's bytes as a writeable uint8 NumPy view (no copy)."""
    t = obj.tensor
    if t is None or t.device.type != "cpu":
        raise KvcxSerdeError(f"{where}: the kvcx serde needs a CPU memory object with a tensor")
    if not t.is_contiguous():
        raise KvcxSerdeError(f"{where}: the memory object's tensor is not contiguous")
    return t.view(torch.uint8).reshape(-1).numpy()


def _kv_view(obj: MemoryObj, where: str, backend: Optional[str] = None):
    """The chunk as a NumPy view of a CPU memory object, or as a torch view (no copy) where it lives on a
    device or the serde's backend is Triton (then the codecs work it there)."""
    shapes = obj.get_shapes() if obj.meta.shapes is not None else [obj.get_shape()]
    dtypes = obj.get_dtypes() if obj.meta.dtypes is not None else [obj.get_dtype()]
    shape, dtype = _layout_of(shapes, dtypes, where)
    t = obj.tensor
    if t is not None and (t.device.type != "cpu" or backend == "triton"):
        if not t.is_contiguous():
            raise KvcxSerdeError(f"{where}: the memory object's tensor is not contiguous")
        flat, n = t.view(torch.uint8).reshape(-1), int(np.prod(shape)) * dtype.itemsize
        if flat.numel() < n:
            raise KvcxSerdeError(f"{where}: the memory object holds {flat.numel()} bytes, its layout needs {n}")
        return flat[:n].view(dtypes[0]).view(shape)
    raw = _bytes_of(obj, where)
    n = int(np.prod(shape)) * dtype.itemsize
    if raw.size < n:
        raise KvcxSerdeError(f"{where}: the memory object holds {raw.size} bytes, its layout needs {n}")
    return raw[:n].view(dtype).reshape(shape)


def key_bytes(key: Optional[ObjectKey]) -> Optional[bytes]:
    """What a chunk is bound to: every field of LMCache's ObjectKey (model, rank, group, salt, chunk hash)."""
    if key is None:
        return None
    fields = (key.model_name, key.kv_rank, getattr(key, "object_group_id", 0), getattr(key, "cache_salt", ""))
    return "\x00".join(map(str, fields)).encode("utf-8") + b"\x00" + bytes(key.chunk_hash)


def _where(key: Optional[ObjectKey]) -> str:
    if key is None:
        return "KV chunk"
    return f"KV chunk {key.chunk_hash.hex()[:16]} of {key.model_name!r}"


class KvcxSerializer(Serializer):
    """Packs an LMCache KV chunk (any layout of :mod:`kvcx.formats.layouts`) with kvcx (see
    :class:`kvcx.formats.chunk.ChunkCodec`)."""

    def __init__(self, codec: Optional[ChunkCodec] = None):
        self.codec = codec or ChunkCodec()

    def serialize(self, src: MemoryObj, dst: MemoryObj, key: ObjectKey) -> int:
        where = _where(key)
        chunk = _kv_view(src, where, self.codec.config.value.backend)
        return self.codec.encode_into(chunk, _bytes_of(dst, where), where, key=key_bytes(key))

    def estimate_serialized_size(self, layout_desc: MemoryLayoutDesc) -> int:
        shape, dtype = _layout_of(layout_desc.shapes, layout_desc.dtypes, "layout")
        return self.codec.serialized_size(shape, dtype)


class KvcxDeserializer(Deserializer):
    """Decodes a kvcx chunk into an LMCache memory object of the layout it was written from (settings from the
    chunk itself)."""

    def __init__(self, codec: Optional[ChunkCodec] = None):
        self.codec = codec or ChunkCodec()

    def deserialize(self, src: MemoryObj, dst: MemoryObj, key: ObjectKey) -> None:
        where = _where(key)
        out = _kv_view(dst, where, self.codec.config.value.backend)
        self.codec.decode_into(_bytes_of(src, where), out, where, key=key_bytes(key))


def create_serde(options: dict) -> SerdeProcessor:
    """LMCache's factory signature: the serde config's options -> an async serde processor."""
    codec, workers = chunk_codec_from_options({k: v for k, v in options.items() if k != "type"})
    return AsyncSerdeProcessor(KvcxSerializer(codec), KvcxDeserializer(codec), max_workers=workers)


_REGISTERED = set()   # the names this module registered create_serde under


def register(name: str = SERDE_NAME) -> str:
    """Register the kvcx serde with LMCache under ``name`` (through LMCache's public
    ``register_serde_factory``; calling it again for a name kvcx registered does nothing)."""
    if name in _REGISTERED and name in get_registered_serde_types():
        return name
    if name in get_registered_serde_types():
        raise KvcxSerdeError(f"an LMCache serde named {name!r} is already registered; pass another name")
    register_serde_factory(name, create_serde)
    _REGISTERED.add(name)
    return name


# ---------------------------------------------------------------------------------------------------------------
# the server launcher (kvcx lmcache-server)
# ---------------------------------------------------------------------------------------------------------------

L2_FLAG = "--l2-adapter"


def l2_adapter_configs(args: Iterable[str]) -> List[dict]:
    """The JSON objects of every ``--l2-adapter`` flag (``--l2-adapter JSON`` or ``--l2-adapter=JSON``)."""
    args, found = list(args), []
    for i, a in enumerate(args):
        if a == L2_FLAG:
            if i + 1 >= len(args):
                raise KvcxError(f"{L2_FLAG} needs a JSON object after it")
            text = args[i + 1]
        elif a.startswith(L2_FLAG + "="):
            text = a[len(L2_FLAG) + 1:]
        else:
            continue
        try:
            cfg = json.loads(text)
        except ValueError as exc:
            raise KvcxError(f"{L2_FLAG} {text[:80]!r} is not JSON ({exc}); quote it for the shell") from None
        if not isinstance(cfg, dict):
            raise KvcxError(f"{L2_FLAG} {text[:80]!r} must be a JSON object with a \"type\"")
        found.append(cfg)
    return found


NODE_TIMEOUT_S = 3.0   # a store node that does not answer a PING in this long at start is unreachable


def store_nodes(cfg: dict) -> List[tuple]:
    """The (host, port) nodes an L2 adapter config names: a Valkey/Redis adapter's ``startup_nodes`` ("host:port,
    ..." or a list; a cluster's seeds) or a RESP adapter's ``host`` and ``port``; none for other adapters."""
    kind = cfg.get("type")
    if kind == "valkey":
        raw = cfg.get("startup_nodes")
        items = raw.split(",") if isinstance(raw, str) else raw if isinstance(raw, list) else None
        if not items:
            raise KvcxError(f"startup_nodes must be \"host:port,host:port,...\" (a cluster: every seed node), got "
                            f"{raw!r}")
        return [_host_port(item) for item in items]
    if kind == "resp" and "host" in cfg and "port" in cfg:
        return [(str(cfg["host"]), int(cfg["port"]))]
    return []


def _host_port(item) -> tuple:
    """A startup node ("host:port", or a [host, port] pair) as (host, port); KvcxError when it is neither."""
    if isinstance(item, str):
        host, _, port = item.strip().rpartition(":")
    elif isinstance(item, (list, tuple)) and len(item) == 2:
        host, port = str(item[0]), str(item[1])
    else:
        host = port = ""
    if not host or not port.isdigit() or not 0 < int(port) <= 0xFFFF:
        raise KvcxError(f"startup node {item!r} is not host:port")
    return host, int(port)


def _node_fault(host: str, port: int) -> Optional[str]:
    """Why a RESP server on (host, port) cannot be used (None: it answers PING, or asks for auth)."""
    import socket

    try:
        with socket.create_connection((host, port), timeout=NODE_TIMEOUT_S) as c:
            c.settimeout(NODE_TIMEOUT_S)
            c.sendall(b"PING\r\n")
            reply = c.recv(64)
    except OSError as exc:
        return exc.strerror or type(exc).__name__
    return None if reply[:1] in (b"+", b"-") else f"it answered {reply[:20]!r}, not as a Redis/Valkey server"


def check_server_args(args: Iterable[str], serde_name: str = "kvcx") -> int:
    """Check every kvcx serde config in the flags and that every store node they name answers (KvcxError naming
    the adapter and the option or node); returns how many adapters use the kvcx serde."""
    n = 0
    for i, cfg in enumerate(l2_adapter_configs(args)):
        where = f"{L2_FLAG} #{i + 1} ({cfg.get('type', '?')})"
        try:
            nodes = store_nodes(cfg)
        except (KvcxError, TypeError, ValueError) as exc:
            raise KvcxError(f"{where}: {exc}") from None
        for host, port in nodes:
            fault = _node_fault(host, port)
            if fault:
                raise KvcxError(f"{where}: store node {host}:{port} does not answer ({fault}); start it, or leave it "
                                "out of the adapter's nodes (a cluster's seeds must all answer at start)")
        serde = cfg.get("serde")
        if isinstance(serde, dict) and serde.get("type") == serde_name:
            try:
                chunk_codec_from_options({k: v for k, v in serde.items() if k != "type"})
            except KvcxError as exc:
                raise KvcxError(f"{where}: {exc}") from None
            n += 1
    return n


def run_server(args: Iterable[str]) -> None:
    """LMCache's multiprocess server with the kvcx serde registered in its process (``kvcx lmcache-server``).

    LMCache builds its L2 adapters, and their serdes, inside ``lmcache server``; a serde registered in another
    process is unknown there. This registers kvcx, checks every kvcx serde config among the ``--l2-adapter``
    flags (a bad option fails at the start, naming the option, not at the first store), then hands all the flags
    to LMCache's own ``lmcache server`` entry point unchanged (returns when the server stops; LMCache exits the
    process on its own errors)::

        kvcx lmcache-server --port 5555 --supported-transfer-mode auto --eviction-policy LRU --l1-size-gb 1 \\
            --l2-adapter '{"type": "fs", "base_path": "/var/cache/kv",
                           "serde": {"type": "kvcx", "head_dim": 64, "layout": "vllm_cpu", "block_size": 128}}'

    (``--supported-transfer-mode auto``: with vLLM on the CPU the engine drives the transfers.) A Valkey/Redis
    cluster: ``{"type": "valkey", "cluster_mode": true, "startup_nodes": "10.0.0.1:7000,10.0.0.2:7000,...", "serde":
    {...}}`` (LMCache's valkey adapter; every node named must answer when the server starts).
    """
    args = list(args)
    check_server_args(args)
    from lmcache.cli.main import main as lmcache_main

    register()
    lmcache_main(["server", *args])
