"""KV-cache utilities (torch / transformers imported lazily).

Saved caches use the reference layout: tensors ``layer_{i}_key`` / ``layer_{i}_value``
of shape ``[1, kv_heads, seq_len, head_dim]`` in a safetensors file, plus a
``<path>.metadata.json`` sidecar. bfloat16 caches are kept exactly as BF16 (no
widening to float32); float16 and float32 stay as they are.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional, Tuple

import numpy as np

from kvcx.codecs.backends import backend_name, backend_takes, check_backend, is_tensor
from kvcx.codecs.tensors import numpy_to_torch, torch_to_numpy
from kvcx.codecs.metrics import ErrorStats, error_stats
from kvcx.deps import decoder_of, import_torch, output_cache
from kvcx.errors import KvcxError
from kvcx.formats import safetensors as st

# TinyLlama-1.1B, the model the reference design names
TINYLLAMA_NUM_LAYERS = 22
TINYLLAMA_NUM_KV_HEADS = 4
TINYLLAMA_HEAD_DIM = 64


@dataclass
class KVCacheMetadata:
    num_layers: int
    num_kv_heads: int
    seq_len: int
    head_dim: int
    dtype: str
    model_name: str

    def to_dict(self) -> dict:
        return asdict(self)


def cache_layers(cache) -> List[Tuple[object, object]]:
    """[(key, value)] per layer of a transformers cache (DynamicCache or legacy tuples); a hybrid model's cache
    (linear-attention layers): its attention layers' (:func:`attention_layers` gives their indices)."""
    if hasattr(cache, "layers"):
        return [(k, v) for _, k, v in attention_layers(cache)]
    if hasattr(cache, "key_cache"):
        return list(zip(cache.key_cache, cache.value_cache))
    return [(k, v) for k, v in cache]


def attention_layers(cache) -> List[Tuple[int, object, object]]:
    """[(layer index, key, value)] of a transformers cache's layers that hold keys and values (a hybrid model's
    linear-attention layers hold recurrent states instead: they are left out)."""
    out = []
    for i, layer in enumerate(cache.layers):
        k, v = getattr(layer, "keys", None), getattr(layer, "values", None)
        if k is not None and v is not None and getattr(k, "dim", lambda: 0)() == 4:
            out.append((i, k, v))
    return out


def is_hybrid(cache) -> bool:
    """Whether a transformers cache is a hybrid model's: layers with no keys and values (linear attention), or
    sliding ones (a window's tokens only): a compressed copy is then the cache itself with its attention layers'
    tensors replaced (:func:`refill`), not a cache rebuilt from tensors alone."""
    layers = getattr(cache, "layers", ())
    return any(getattr(layer, "is_sliding", False) or getattr(layer, "keys", None) is None for layer in layers)


def _device_of(device, name: str):
    """``device`` for tensor ``name``: one device for every tensor, or a mapping name -> device (a model spread
    over several GPUs: :func:`tensor_devices`)."""
    return device.get(name) if isinstance(device, dict) else device


def tensor_devices(cache) -> Dict[str, object]:
    """Where each of the cache's tensors is (``layer_{i}_key`` -> device): for a model spread over several GPUs
    (``device_map="auto"``) a compressed copy goes back layer by layer to where the model keeps that layer."""
    return {name: t.device for name, t in cache_to_device_tensors(cache).items()}


def refill(template, decoded: Dict[str, object], device=None):
    """A copy of the cache ``template`` (a hybrid model's, as its prefix left it) whose attention layers hold the
    ``decoded`` tensors (``layer_{i}_key`` / ``_value``) in place of their own: its linear-attention states and its
    sliding layers' positions stay. The decoded tensors must keep each layer's shape (token eviction changes it:
    not on a hybrid model's cache). ``device``: one device, or a mapping from tensor name (:func:`tensor_devices`)."""
    import copy

    cache = copy.deepcopy(template)
    for i, k, v in attention_layers(cache):
        new = []
        for kind, old in (("key", k), ("value", v)):
            name = f"layer_{i}_{kind}"
            t, dev = decoded[name], _device_of(device, name)
            t = t.to(dev) if is_tensor(t) else numpy_to_torch(t, dev)
            if tuple(t.shape) != tuple(old.shape):
                raise KvcxError(f"layer {i}: the compressed {kind}s are {list(t.shape)}, the cache's {list(old.shape)}; "
                                "token eviction (a press) runs on full-attention models' caches only")
            new.append(t.to(old.dtype))
        cache.layers[i].keys, cache.layers[i].values = new
    return cache


def rebuilt(template, decoded: Dict[str, object], device=None):
    """The compressed cache to score: :func:`refill` of the prefix's cache for a hybrid model, else a cache built
    from the decoded tensors (:func:`make_dynamic_cache`: layers of uneven counts where a press evicted tokens).
    ``device``: one device, or a mapping from tensor name to device (:func:`tensor_devices`)."""
    if template is not None and is_hybrid(template):
        return refill(template, decoded, device)
    return make_dynamic_cache(tensors_to_layers(decoded, device))


def make_dynamic_cache(layers, config=None):
    """A DynamicCache holding the given [(key, value)] tensors; where a press left the layers holding different
    counts, an :class:`~kvcx.cache.pressing.EvictedCache` (run the model over it under
    :func:`kvcx.quality.eviction.attending`: transformers builds one mask for all layers)."""
    if len({k.shape[-2] for k, _ in layers}) > 1:
        from kvcx.cache.pressing import EvictedCache as DynamicCache
    else:
        from transformers import DynamicCache

    cache = DynamicCache()
    for i, (k, v) in enumerate(layers):
        cache.update(k, v, i)
    return cache


def cache_to_tensors(cache) -> Dict[str, np.ndarray]:
    """The cache's attention layers' tensors by name (``layer_{i}_key``, its own layer index), as NumPy arrays."""
    out = {}
    for i, k, v in (attention_layers(cache) if hasattr(cache, "layers") else enumerate_pairs(cache)):
        out[f"layer_{i}_key"] = torch_to_numpy(k)
        out[f"layer_{i}_value"] = torch_to_numpy(v)
    return out


def tensors_to_layers(tensors: Dict[str, np.ndarray], device=None):
    n = len([k for k in tensors if k.endswith("_key") and k.startswith("layer_")])
    layers = []
    for i in range(n):
        pair = []
        for kind in ("key", "value"):
            name = f"layer_{i}_{kind}"
            if name not in tensors:
                raise KvcxError(f"KV cache is missing tensor {name!r}; expected layer_{{i}}_key / "
                                f"layer_{{i}}_value for i in 0..{n - 1}")
            a = tensors[name]
            if np.ndim(a) != 4 or 0 in np.shape(a):
                raise KvcxError(f"KV cache tensor {name!r} has shape {list(np.shape(a))}; expected "
                                "[batch, kv_heads, seq_len, head_dim] with no empty dimension")
            pair.append(a)
        if pair[0].shape[:-1] != pair[1].shape[:-1]:   # widths may differ (MLA: the latent and the RoPE key)
            raise KvcxError(f"KV cache layer {i}: key {list(pair[0].shape)} and value {list(pair[1].shape)} "
                            "differ in batch, heads or tokens; a layer's keys and values must agree in all but "
                            "their last dimension")
        devs = [_device_of(device, f"layer_{i}_{kind}") for kind in ("key", "value")]
        layers.append(tuple(a.to(d) if is_tensor(a) else numpy_to_torch(a, d) for a, d in zip(pair, devs)))
    return layers


def _metadata(layers, model_name: str) -> KVCacheMetadata:
    k0 = layers[0][0]
    return KVCacheMetadata(num_layers=len(layers), num_kv_heads=int(k0.shape[1]), seq_len=int(k0.shape[2]),
                           head_dim=int(k0.shape[3]), dtype=str(k0.dtype).replace("torch.", ""),
                           model_name=model_name)


def extract_kv_cache(model, tokenizer, prompt: str, max_length: Optional[int] = None, device=None):
    """Run ``prompt`` through ``model`` once; returns (DynamicCache, KVCacheMetadata). Batch 1 only."""
    torch = import_torch()
    if not isinstance(prompt, str):
        raise KvcxError(f"extract_kv_cache takes one prompt string (batch size 1), got {type(prompt).__name__}")
    enc = tokenizer(prompt, return_tensors="pt", truncation=max_length is not None, max_length=max_length)
    ids = enc["input_ids"]
    if ids.shape[0] != 1:
        raise KvcxError(f"extract_kv_cache supports batch size 1, got {ids.shape[0]}")
    if ids.shape[1] == 0:
        raise KvcxError("the prompt tokenized to 0 tokens; the KV cache would be empty, give a non-empty prompt")
    device = device if device is not None else next(model.parameters()).device
    with torch.no_grad():
        # the decoder alone: the cache is what is wanted, not [T, vocabulary] logits (786 MB at 4,000 tokens)
        cache = output_cache(decoder_of(model)(input_ids=ids.to(device), use_cache=True))
    layers = cache_layers(cache)
    if not layers or layers[0][0] is None or layers[0][0].numel() == 0:
        raise KvcxError("the model returned an empty KV cache")
    name = getattr(model.config, "_name_or_path", "") or getattr(model.config, "model_type", "model")
    return cache, _metadata(layers, str(name))


def save_kv_cache(cache, path, metadata: Optional[KVCacheMetadata] = None) -> str:
    """Write ``layer_{i}_key/value`` to a safetensors file (atomically) and the metadata sidecar."""
    from kvcx.formats.atomic import OutputSet, write_bytes_to

    path = os.fspath(path)
    side = path + ".metadata.json"
    outs = OutputSet([path, side]).check()
    tensors = cache_to_tensors(cache)
    if not tensors:
        raise KvcxError("the KV cache is empty; nothing to save")
    meta = metadata or _metadata(cache_layers(cache), "unknown")
    with outs as tmp:  # the file and its sidecar land together or not at all
        st.write_to(tmp[path], path, tensors)
        write_bytes_to(tmp[side], side, [json.dumps(meta.to_dict(), indent=2).encode("utf-8")])
    return path


def load_kv_cache(path, device=None):
    """(DynamicCache, KVCacheMetadata) from a file written by :func:`save_kv_cache` (or a kvcx packed file)."""
    from kvcx.formats.jsonio import read_sidecar
    from kvcx.formats.packed import decompress_tensors, is_packed

    with st.SafeFile(path) as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        metadata = f.metadata
    if is_packed(metadata):
        tensors = decompress_tensors(tensors, metadata, source=os.fspath(path))
    try:
        layers = tensors_to_layers(tensors, device)
    except KvcxError as exc:
        raise KvcxError(f"{path}: {exc}") from None
    if not layers:
        raise KvcxError(f"{path}: no layer_{{i}}_key / layer_{{i}}_value tensors; not a kvcx KV-cache file")
    side = read_sidecar(path) or {}
    meta = _metadata(layers, str(side.get("model_name", "unknown")))
    return make_dynamic_cache(layers), meta


def expected_kv_shape(config) -> Tuple[int, int, int]:
    """(layers, kv heads, head_dim) from a transformers config (a multimodal one: its decoder's)."""
    from kvcx.cache.layer_types import text_config

    config = text_config(config)
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return int(config.num_hidden_layers), int(heads), int(head_dim)


def validate_kv_cache_shape(cache, config=None, expected: Optional[Tuple[int, int, int]] = None) -> None:
    """Raise KvcxError unless every layer is [batch, kv_heads, seq, head_dim] as the model expects.

    ``expected`` defaults to the model config's values, or to TinyLlama's constants without a config.
    """
    if expected is None:
        expected = expected_kv_shape(config) if config is not None else (
            TINYLLAMA_NUM_LAYERS, TINYLLAMA_NUM_KV_HEADS, TINYLLAMA_HEAD_DIM)
    n_layers, heads, head_dim = expected
    layers = cache_layers(cache)
    if len(layers) != n_layers:
        raise KvcxError(f"KV cache has {len(layers)} layers, the model has {n_layers}")
    for i, (k, v) in enumerate(layers):
        for kind, t in (("key", k), ("value", v)):
            if t.dim() != 4 or t.shape[1] != heads or t.shape[3] != head_dim:
                raise KvcxError(f"layer {i} {kind} has shape {list(t.shape)}; expected [batch, {heads}, seq, "
                                f"{head_dim}]")
        if k.shape != v.shape:
            raise KvcxError(f"layer {i}: key {list(k.shape)} and value {list(v.shape)} shapes differ")


def compute_kv_cache_stats(cache) -> dict:
    """Size and value statistics of a cache (per kind, over all layers)."""
    layers = cache_layers(cache)
    stats = {"num_layers": len(layers), "total_bytes": 0, "num_values": 0}
    for kind, idx in (("key", 0), ("value", 1)):
        arrs = [torch_to_numpy(layer[idx]).astype(np.float32) for layer in layers]
        flat = np.concatenate([a.reshape(-1) for a in arrs]) if arrs else np.zeros(0, np.float32)
        stats[kind] = {"mean": float(flat.mean()) if flat.size else 0.0,
                       "std": float(flat.std()) if flat.size else 0.0,
                       "min": float(flat.min()) if flat.size else 0.0,
                       "max": float(flat.max()) if flat.size else 0.0,
                       "abs_max": float(np.abs(flat).max()) if flat.size else 0.0}
        stats["total_bytes"] += int(sum(layer[idx].numel() * layer[idx].element_size() for layer in layers))
        stats["num_values"] += int(flat.size)
    if layers:
        stats["shape"] = list(layers[0][0].shape)
        stats["dtype"] = str(layers[0][0].dtype).replace("torch.", "")
    return stats


def roundtrip_tensors(tensors: Dict[str, np.ndarray], config, n_threads=None):
    """Compress with the file path's code (packed safetensors bytes), read back and decode.

    Returns (decoded tensors, packed size in bytes, ErrorStats over all values). Tensors of layers the config keeps
    exact (an engine's layers in the model's dtype) count as FP16, what the engine holds them in on its GPU, whatever
    dtype the model here runs in.
    """
    from kvcx.formats.packed import compress_tensors, decompress_tensors

    packed, meta, chosen = compress_tensors(tensors, config)
    blob = st.save(packed, meta)
    kept = [a for name, a in tensors.items() if name not in chosen and a.dtype.itemsize > 2 and a.size
            and config.codec_for(name)[0] == "kept"]
    size = len(blob) + sum(2 * a.size - a.nbytes for a in kept)
    loaded, loaded_meta = st.load_with_metadata(blob)
    decoded = decompress_tensors(loaded, loaded_meta, n_threads=n_threads)
    total = ErrorStats()
    for name, a in tensors.items():
        total += error_stats(a, decoded[name], name=name, n_threads=n_threads)
    return decoded, size, total


def cache_to_device_tensors(cache) -> Dict[str, object]:
    """The cache's tensors by name, where they are (torch tensors on the model's device; no copies)."""
    out = {}
    for i, k, v in (attention_layers(cache) if hasattr(cache, "layers") else enumerate_pairs(cache)):
        out[f"layer_{i}_key"], out[f"layer_{i}_value"] = k, v
    return out


def enumerate_pairs(cache) -> List[Tuple[int, object, object]]:
    """[(index, key, value)] of a legacy cache (tuples, or key_cache / value_cache lists)."""
    return [(i, k, v) for i, (k, v) in enumerate(cache_layers(cache))]


def backend_of(config, device_type: str, backend: Optional[str] = None, dims=None) -> str:
    """Where ``validate`` encodes and decodes a setting's cache: "triton" (on the device, the Triton kernels)
    when every codec of the setting runs there (``backend="triton"`` forces it: KvcxError if one cannot; None:
    chosen by the model's device, CUDA for 4-bit integer, E8P and widths codecs), else "cpu" (the CPU kernels and the
    packed file format, on the host). ``dims``: the (key width, value width) pairs of the model's packed layers once
    it is loaded: the setting's fallback codec counts only where its codecs cannot take one of them (kvcx2v's E8P on
    a head dim that is not a power of two); None (before the model loads): the fallback is not counted."""
    check_backend(backend)
    if backend == "cpu":
        return "cpu"
    if getattr(config, "key_rope", None) is not None:   # the frame change is the host's (kvcx.codecs.rope)
        if backend == "triton":
            raise KvcxError("--backend triton: keys coded before RoPE are turned on the host; pass --backend cpu "
                            "(or leave it out)")
        return "cpu"
    named = config.codecs()
    codecs = [c for n, c in named.items() if n != "fallback"]

    def takes(name: str, codec, kd, vd) -> bool:
        width = kd if name.startswith("key") else vd
        return width is not None and codec.supports((1, 1, 64, int(width)))

    if dims is not None and (not dims or not all(takes(n, c, kd, vd) for n, c in named.items() if n != "fallback"
                                                 for kd, vd in dims)):
        codecs.append(named["fallback"])   # a layer's tensors go to the fallback (or the widths are not known)
    if backend == "triton":
        bad = sorted({c.describe() for c in codecs if not backend_takes(c, "triton")})
        if bad:
            raise KvcxError(f"--backend triton runs 4-bit integer, E8P and widths codecs; this setting has "
                            f"{', '.join(bad)} (its codec, or its fallback for a head dim the codec cannot take): "
                            "pass --backend cpu (or leave it out)")
        return "triton"
    return "triton" if all(backend_name(c, device_type) == "triton" for c in codecs) else "cpu"


def model_frame(setting, model):
    """A kvcx setting as it runs on ``model``: its MLA layers named (:meth:`KVConfig.with_latent_layers
    <kvcx.codecs.KVConfig.with_latent_layers>`: their RoPE key coded as :class:`~kvcx.cache.KvcxCache` codes it, so
    every mode of the gate, calibrate and retrieval code what the cache holds), and keys coded before RoPE with the
    model's own frequencies (``key_rope="model"``) given them (:func:`kvcx.codecs.rope.model_key_rope`); any other
    setting (a peer's, a press) as it is."""
    from kvcx.codecs.rope import MODEL, model_key_rope

    if hasattr(setting, "with_latent_layers") and not setting.latent_layers:
        from kvcx.cache.layer_types import layer_specs

        latent = [s.index for s in layer_specs(model.config) if s.latent]
        if latent:
            setting = setting.with_latent_layers(latent)
    if getattr(setting, "key_rope", None) == MODEL:
        try:
            return setting.with_key_rope(model_key_rope(model))
        except ValueError as exc:
            raise KvcxError(str(exc)) from None
    return setting


def model_dims(model_config) -> set:
    """The (key width, value width) pairs of a model's packed layers (:func:`backend_of`'s ``dims``)."""
    from kvcx.cache.layer_types import layer_specs

    return {(s.key_dim, s.value_dim) for s in layer_specs(model_config) if s.packed}   # None: a width not said


class DeviceRoundtrip:
    """A setting's round trip on the device: every tensor of the cache encoded and decoded where it is by the
    Triton kernels (the same bytes as the CPU kernels), the error sums in float64 there. Size: the packed
    records' bytes (codes, scales, zero points, sinks; the packed file adds only its header)."""

    def __init__(self, config):
        self.config = config.with_backend("triton")

    def __call__(self, tensors: Dict[str, object]):
        decoded, nbytes, total = {}, 0, ErrorStats()
        for name, t in tensors.items():
            _, codec = self.config.codec_for(name, tuple(t.shape))
            if codec is None:    # a layer the setting keeps exact: FP16 on the engine's GPU (roundtrip_tensors)
                decoded[name], nbytes = t, nbytes + 2 * t.numel()
                sq = float((t.double() ** 2).sum())
                total += ErrorStats(n=t.numel(), sum_xx=sq, sum_yy=sq, sum_xy=sq)
                continue
            p = codec.encode(t, name=name)
            y = codec.decode(p, name=name)
            decoded[name], nbytes = y, nbytes + p.nbytes
            a, b = t.double(), y.double()
            e = a - b
            total += ErrorStats(n=a.numel(), sum_xx=float((a * a).sum()), sum_ee=float((e * e).sum()),
                                sum_yy=float((b * b).sum()), sum_xy=float((a * b).sum()),
                                max_error=float(e.abs().max()) if a.numel() else 0.0)
        return decoded, nbytes, total


def original_nbytes(tensors: Dict[str, object]) -> int:
    """Bytes of the tensors (NumPy arrays or torch tensors) as they are held."""
    return int(sum(a.nbytes for a in tensors.values()))


def value_count(tensors: Dict[str, object]) -> int:
    """Values in the tensors (NumPy arrays or torch tensors)."""
    return int(sum(a.numel() if is_tensor(a) else a.size for a in tensors.values()))


__all__ = ["KVCacheMetadata", "extract_kv_cache", "save_kv_cache", "load_kv_cache", "validate_kv_cache_shape",
           "compute_kv_cache_stats", "roundtrip_tensors", "TINYLLAMA_NUM_LAYERS", "TINYLLAMA_NUM_KV_HEADS",
           "TINYLLAMA_HEAD_DIM"]
