"""Keys coded before RoPE: the frame change around a key codec (``KVConfig(key_rope=...)``, docs/FORMAT.md 2.9).

A model's cache holds its keys after the rotary embedding: channel ``i`` and ``i + R/2`` of the first ``R`` (the
rotary dims; transformers' ``rotate_half`` layout) are one pair turned by ``position * inv_freq[i]``. Across a group
of tokens a fast pair sweeps a circle, so a codec grouping keys per channel along tokens (the widths keys) spends its
range on the turning instead of the key. Turned back (``to_frame``) the pairs sit still, the codec codes them there,
and the decoded keys are turned forward again (``from_frame``) before attention reads them, as KVQuant does
(Hooper et al., 2024, "pre-RoPE" keys). The turn is exact up to the tensor's own rounding: both directions use the
same float64 angles, so it undoes itself; token ``t`` of a tensor sits at position ``offset + t`` in every row
(one sequence, or a batch without left padding).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

import numpy as np

from kvcx.errors import CodecError

# ``KVConfig(key_rope=MODEL)``: the model's own frequencies, filled in where the model is loaded (kvcx.quality)
MODEL = "model"
MAX_PAIRS = 4096


@dataclass(frozen=True)
class KeyRope:
    """The rotary frame keys are coded in: ``inv_freq`` (the rotary pairs' frequencies, radians per position,
    ``R/2`` of them) and the position of a tensor's first token (``offset``)."""

    inv_freq: Tuple[float, ...]
    offset: int = 0

    def __post_init__(self):
        f = self.inv_freq
        if isinstance(f, np.ndarray):
            f = f.tolist()
        if not isinstance(f, (tuple, list)) or not 0 < len(f) <= MAX_PAIRS or \
                not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
                        for v in f):
            raise CodecError(f"key_rope: inv_freq must be 1 to {MAX_PAIRS} finite frequencies >= 0 (radians a "
                             "position, as the model's rotary embedding holds them); got "
                             f"{str(self.inv_freq)[:80]}")
        if isinstance(self.offset, bool) or not isinstance(self.offset, (int, np.integer)) or \
                not 0 <= self.offset < 2 ** 40:
            raise CodecError(f"key_rope: offset (the first token's position) must be an integer >= 0, "
                             f"got {self.offset!r}")
        object.__setattr__(self, "inv_freq", tuple(float(v) for v in f))
        object.__setattr__(self, "offset", int(self.offset))

    @property
    def rotary_dims(self) -> int:
        return 2 * len(self.inv_freq)

    def get_config(self) -> dict:
        return {"inv_freq": list(self.inv_freq), "offset": self.offset}

    @classmethod
    def from_config(cls, config) -> "KeyRope":
        if not isinstance(config, dict) or set(config) - {"inv_freq", "offset"} or "inv_freq" not in config:
            raise CodecError(f"key_rope must be an object with inv_freq (and offset), or {MODEL!r}; "
                             f"got {str(config)[:80]}")
        return cls(inv_freq=config["inv_freq"], offset=config.get("offset", 0))

    def check(self, shape: tuple, name: str = "tensor") -> None:
        if len(shape) < 2 or shape[-1] < self.rotary_dims:
            raise CodecError(f"tensor {name!r} of shape {list(shape)}: keys coded before RoPE need a last dim of at "
                             f"least the {self.rotary_dims} rotary dims of key_rope; is it this model's cache?")

    def _cos_sin(self, S: int):
        angle = (self.offset + np.arange(S, dtype=np.float64))[:, None] * np.asarray(self.inv_freq)[None, :]
        return np.cos(angle), np.sin(angle)

    def _turn(self, x: np.ndarray, sign: float, name: str) -> np.ndarray:
        self.check(x.shape, name)
        h = len(self.inv_freq)
        c, s = self._cos_sin(x.shape[-2])
        a = x[..., :h].astype(np.float64)
        b = x[..., h:2 * h].astype(np.float64)
        out = np.array(x, copy=True)
        out[..., :h] = a * c - sign * b * s
        out[..., h:2 * h] = b * c + sign * a * s
        return out

    def to_frame(self, x: np.ndarray, name: str = "tensor") -> np.ndarray:
        """Keys after RoPE (``[..., tokens, head_dim]``) turned back to the frame before it (a new array)."""
        return self._turn(np.asarray(x), -1.0, name)

    def from_frame(self, x: np.ndarray, name: str = "tensor") -> np.ndarray:
        """The inverse of :meth:`to_frame`: keys before RoPE turned to their positions (a new array)."""
        return self._turn(np.asarray(x), 1.0, name)

    def at(self, offset: int) -> "KeyRope":
        return KeyRope(self.inv_freq, offset)


def check_key_rope(value) -> Optional[object]:
    """A KVConfig's ``key_rope``: None, :data:`MODEL` or a :class:`KeyRope` (an object of its config)."""
    if value is None or value == MODEL or isinstance(value, KeyRope):
        return value
    if isinstance(value, dict):
        return KeyRope.from_config(value)
    raise CodecError(f"key_rope must be None, {MODEL!r} (the model's own RoPE) or a KeyRope, got {value!r}")


def model_key_rope(model) -> KeyRope:
    """The RoPE frequencies of a loaded transformers model with one rotary embedding for every layer
    (``model.model.rotary_emb.inv_freq``, the ``rotate_half`` layout); CodecError for any other model."""
    inner = getattr(model, "model", model)
    rot = getattr(inner, "rotary_emb", None)
    freq = getattr(rot, "inv_freq", None)
    kind = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
    if freq is None:
        raise CodecError(f"keys coded before RoPE need the model's rotary frequencies; model type {kind!r} has no "
                         "single rotary embedding (model.rotary_emb.inv_freq): leave the option out")
    return KeyRope(inv_freq=tuple(float(v) for v in freq.detach().cpu().double().numpy().ravel()))
