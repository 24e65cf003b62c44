"""Token eviction: codecs of the token axis ("presses", as NVIDIA's kvpress names them).

A press keeps ``keep`` of a layer's cached tokens (per KV head, the same count for every head, so the kept cache
stays one [heads, kept, head_dim] block) and drops the rest; a kvcx scheme then packs what is kept. In a scheme
string a press composes with any codec by ``+``, and always runs before it, whatever the order written:

    kvcx+snapkv:0.5      keep half the tokens (SnapKV), then the default codec
    snapkv:0.25          eviction alone: a quarter of the tokens, at full precision
    streaming:0.5+kvcx3  StreamingLLM's sinks and recent window, then kvcx3

The presses (each registered in :data:`PRESSES`; a new press registers, nothing else changes):

- ``streaming`` (StreamingLLM, Xiao et al. 2024): the first ``sinks`` tokens (4) and the most recent ones;
- ``knorm`` (Devoto et al. 2024): the keys with the smallest L2 norm, which draw the most attention;
- ``snapkv`` (Li et al. 2024): the attention that the last ``window`` (64) tokens of the context pay to each
  earlier token, averaged over those queries and the query heads that share the KV head, smoothed by an average
  pool of width 5; the window itself is always kept (the queries are the model's: the caller computes them).

Keys are stored after their rotary embedding, so a kept key keeps its position; the tokens that follow attend at
their own positions (the context's length onwards), not at the kept cache's length.

Bytes, counted whole: whatever the codec stores for the kept tokens, plus the kept positions (a uint16 per kept
token and KV head, which addresses contexts up to 65,536 tokens), against the full context's values at 16 bits.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, Optional, Tuple

import numpy as np

from kvcx.errors import KvcxError

INDEX_BITS = 16
SNAPKV_WINDOW = 64
SNAPKV_POOL = 5
STREAMING_SINKS = 4


@dataclass(frozen=True)
class Press:
    """One token-eviction press: ``name`` (a key of :data:`PRESSES`) keeping ``keep`` of the tokens, 0 < keep <= 1."""

    name: str
    keep: float
    options: Dict[str, int] = field(default_factory=dict, compare=False, hash=False)
    # a keep ratio per layer (a calibrated plan's); empty: ``keep`` for every layer
    layer_keep: Tuple[float, ...] = ()

    def __post_init__(self):
        if self.name not in PRESSES:
            raise KvcxError(f"press {self.name!r} does not exist; the presses are {', '.join(sorted(PRESSES))}")
        for r in (self.keep, *self.layer_keep):
            if not (isinstance(r, (int, float)) and 0.0 < float(r) <= 1.0):
                raise KvcxError(f"press {self.name}:{r}: the keep ratio must be in (0, 1] (e.g. {self.name}:0.5 "
                                "keeps half the tokens)")

    @property
    def spec(self) -> str:
        return f"{self.name}:{self.keep:g}" + (" (a keep ratio per layer)" if self.layer_keep else "")

    def keep_at(self, layer: Optional[int]) -> float:
        """Layer ``layer``'s keep ratio (``keep`` where the press has none per layer)."""
        if not self.layer_keep or layer is None:
            return float(self.keep)
        if not 0 <= layer < len(self.layer_keep):
            raise KvcxError(f"press {self.name}: its plan gives keep ratios for {len(self.layer_keep)} layers, not "
                            f"layer {layer}; calibrate a plan for this model")
        return float(self.layer_keep[layer])

    @property
    def needs_queries(self) -> bool:
        return PRESSES[self.name].needs_queries

    @property
    def window(self) -> int:
        return int(self.options.get("window", SNAPKV_WINDOW))

    def kept_count(self, tokens: int, layer: Optional[int] = None) -> int:
        """How many of ``tokens`` the press keeps in ``layer`` (at least one)."""
        return max(1, min(tokens, int(round(self.keep_at(layer) * tokens))))

    def select(self, keys: np.ndarray, queries: Optional[np.ndarray] = None, layer: Optional[int] = None) -> np.ndarray:
        """The kept token indices [kv_heads, kept], ascending, of one layer's keys [kv_heads, tokens, head_dim]
        (``queries`` [query_heads, window, head_dim]: the last window's queries, for the presses that read them;
        ``layer``: which layer, for a press with a keep ratio per layer)."""
        if keys.ndim != 3:
            raise KvcxError(f"press {self.spec}: keys must be [kv_heads, tokens, head_dim], got {list(keys.shape)}")
        heads, tokens, _ = keys.shape
        kept = self.kept_count(tokens, layer)
        if kept == tokens:
            return np.broadcast_to(np.arange(tokens), (heads, tokens)).copy()
        if self.needs_queries and queries is None:
            raise KvcxError(f"press {self.spec} scores tokens with the model's queries; none were given")
        scores = PRESSES[self.name].score(self, keys.astype(np.float32, copy=False), queries, kept)
        top = np.argpartition(-scores, kept - 1, axis=1)[:, :kept]
        return np.sort(top, axis=1)

    def get_config(self) -> dict:
        return {"press": self.name, "keep": float(self.keep), **self.options,
                **({"layer_keep": [float(r) for r in self.layer_keep]} if self.layer_keep else {})}

    @classmethod
    def from_config(cls, config: dict, source: str = "the plan") -> "Press":
        """The press of :meth:`get_config`'s dict (a plan file's ``press`` entry)."""
        try:
            opts = {k: int(v) for k, v in config.items() if k not in ("press", "keep", "layer_keep")}
            return cls(str(config["press"]), float(config["keep"]), opts,
                       tuple(float(r) for r in config.get("layer_keep", ())))
        except (KeyError, TypeError, ValueError) as exc:
            raise KvcxError(f"{source}: its press entry {config!r} is malformed ({exc}); calibrate the plan again") \
                from None


@dataclass(frozen=True)
class PressKind:
    """A registered press: its scoring function (higher = kept) and whether it reads the model's queries."""

    score: Callable[[Press, np.ndarray, Optional[np.ndarray], int], np.ndarray]
    needs_queries: bool = False


PRESSES: Dict[str, PressKind] = {}


def register_press(name: str, needs_queries: bool = False):
    def deco(fn):
        PRESSES[name] = PressKind(fn, needs_queries)
        return fn
    return deco


@register_press("streaming")
def _streaming(press: Press, keys: np.ndarray, _queries, kept: int) -> np.ndarray:
    heads, tokens, _ = keys.shape
    sinks = min(int(press.options.get("sinks", STREAMING_SINKS)), kept)
    pos = np.arange(tokens, dtype=np.float64)
    score = np.where(pos < sinks, np.inf, pos)       # sinks first, then the most recent
    return np.broadcast_to(score, (heads, tokens))


@register_press("knorm")
def _knorm(_press: Press, keys: np.ndarray, _queries, _kept: int) -> np.ndarray:
    return -np.linalg.norm(keys, axis=-1)


@register_press("snapkv", needs_queries=True)
def _snapkv(press: Press, keys: np.ndarray, queries: np.ndarray, _kept: int) -> np.ndarray:
    heads, tokens, dim = keys.shape
    qh, window, qdim = queries.shape
    if qdim != dim or qh % heads:
        raise KvcxError(f"press {press.spec}: queries {list(queries.shape)} do not match keys {list(keys.shape)} "
                        "(query heads a multiple of the KV heads, the same head dim)")
    window = min(window, tokens)
    q = queries[:, -window:].astype(np.float32).reshape(heads, qh // heads, window, dim)
    logits = np.einsum("hgwd,htd->hgwt", q, keys) / np.sqrt(dim)
    # causal inside the window: query i of the window (token tokens - window + i) sees tokens up to its own
    future = np.arange(tokens)[None, :] > (tokens - window + np.arange(window))[:, None]
    logits = np.where(future, -np.inf, logits)
    logits -= logits.max(-1, keepdims=True)
    weights = np.exp(logits)
    weights /= weights.sum(-1, keepdims=True)
    score = weights[..., :tokens - window].mean(axis=(1, 2))            # [heads, tokens - window]
    score = _avg_pool(score, int(press.options.get("pool", SNAPKV_POOL)))
    # the window above every score (weights are at most 1), the most recent first where it alone overflows
    recent = 2.0 + np.arange(window) / window
    return np.concatenate([score, np.broadcast_to(recent, (heads, window))], axis=1)


def _avg_pool(x: np.ndarray, width: int) -> np.ndarray:
    """Average pooling along the last axis, stride 1, zero padding (as torch's avg_pool1d with count_include_pad)."""
    if width <= 1 or x.shape[-1] == 0:
        return x
    pad = width // 2
    padded = np.pad(x, [(0, 0)] * (x.ndim - 1) + [(pad, width - 1 - pad)])
    c = np.cumsum(np.concatenate([np.zeros(x.shape[:-1] + (1,)), padded], axis=-1), axis=-1)
    return (c[..., width:] - c[..., :-width]) / width


@dataclass(frozen=True)
class PressedSetting:
    """A press composed with a codec (``codec`` None: eviction alone, the kept tokens at full precision): what a
    scheme string with a press names. The codec is whatever ``validate`` takes as a setting (a KVConfig, a peer)."""

    press: Press
    codec: object = None

    def get_config(self) -> dict:
        inner = self.codec.get_config() if self.codec is not None else {"scheme": "exact"}
        return {**inner, **self.press.get_config()}

    def check_installed(self) -> None:
        getattr(self.codec, "check_installed", lambda: None)()

    @property
    def scheme(self) -> str:
        return self.press.spec + (f"+{self.codec.scheme}" if self.codec is not None else "")

    def describe(self) -> str:
        inner = self.codec.describe() if self.codec is not None else "the kept tokens at full precision"
        return f"press {self.press.spec} (token eviction), then {inner}"


def parse_press(text: str) -> Press:
    """``name:keep`` (e.g. ``snapkv:0.5``) -> Press, or KvcxError naming the part and how to write it."""
    name, sep, ratio = text.strip().partition(":")
    name = name.strip().lower()
    if name not in PRESSES:
        raise KvcxError(f"press {name!r} does not exist; the presses are {', '.join(sorted(PRESSES))} "
                        "(write name:keep, e.g. snapkv:0.5)")
    if not sep:
        raise KvcxError(f"press {name!r} needs a keep ratio: {name}:0.5 keeps half the tokens")
    try:
        keep = float(ratio)
    except ValueError:
        raise KvcxError(f"press {text!r}: the keep ratio {ratio!r} is not a number; write {name}:0.5") from None
    return Press(name, keep)


def split_scheme(text: str) -> Tuple[Optional[Press], Optional[str]]:
    """A scheme string with ``+`` -> (the press or None, the codec part or None): ``kvcx+snapkv:0.5`` ->
    (snapkv:0.5, "kvcx"). A part is a press when it has a keep ratio (``name:keep``) or names one; at most one
    press and one codec."""
    press, codec = None, None
    for part in (p.strip() for p in text.split("+")):
        if not part:
            raise KvcxError(f"scheme {text!r} has an empty part around '+'; write e.g. kvcx+snapkv:0.5")
        if ":" in part or part.lower() in PRESSES:      # a press (name:keep); scheme names have no ':'
            if press is not None:
                raise KvcxError(f"scheme {text!r} names two presses; compose one press with one codec")
            press = parse_press(part)
        else:
            if codec is not None:
                raise KvcxError(f"scheme {text!r} names two codecs ({codec!r}, {part!r}); compose one press with "
                                "one codec, e.g. kvcx+snapkv:0.5")
            codec = part
    return press, codec


def index_bytes(kv_heads: int, kept: int) -> int:
    """Bytes of one layer's kept positions (a uint16 per kept token and KV head, shared by its key and value)."""
    return kv_heads * kept * INDEX_BITS // 8
