"""A :class:`~kvcx.cache.KvcxCache`'s sliding-window and chunked layers: :class:`KvcxWindowLayer`, a
:class:`~kvcx.cache.layers.KvcxLayer` that holds its window's tokens packed.

A windowed layer (``window`` tokens: a query at position p sees (p - window, p], or, chunked, the tokens of its
chunk) holds the tokens from ``start`` on: the packed chunks a window has left are dropped as the next chunk is
packed, so a layer holds at most the window, one chunk and the residual, at any length. Its steps read the
window's first token on (the kernel's ``skip``), and transformers' mask for the layer (over the window, as
``get_mask_sizes`` tells it) lines up with the tokens read.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from kvcx.cache.layer_types import CHUNKED
from kvcx.cache.layers import KvcxLayer, owned
from kvcx.errors import KvcxError


class KvcxWindowLayer(KvcxLayer):
    """One sliding-window or chunked layer of a :class:`KvcxCache`: the window's tokens, packed (the module's
    docstring). It answers transformers' questions as ``DynamicSlidingWindowLayer`` does: ``get_mask_sizes``
    covers the last ``window - 1`` tokens and the step's, ``get_max_length`` is the window."""

    is_sliding = True
    keeps_sinks = False

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.window = self.spec.window
        self.chunked = self.spec.kind == CHUNKED
        self.start = 0   # the position of the first token held (packed or in the residual)

    def _first_seen(self, Q: int) -> int:
        """The first position transformers' mask covers for this step of Q tokens (its kv_offset)."""
        return max(self.cumulative_length - Q - self.window + 1, 0)

    def get_mask_sizes(self, query_length: int) -> tuple:
        cum = self.cumulative_length
        if cum >= self.window:
            return self.window - 1 + query_length, cum - self.window + 1
        return cum + query_length, 0

    def get_max_length(self) -> int:
        return self.window

    def _mask_length(self, Q: int) -> int:
        return self.cumulative_length - self._first_seen(Q)

    def _visible(self, keys: torch.Tensor, values: torch.Tensor):
        skip = self._first_seen(self._step) - self.start
        return (keys[:, :, skip:], values[:, :, skip:]) if skip > 0 else (keys, values)

    def _check_window(self, sliding_window: Optional[int]) -> None:
        """The window the model's attention names (sliding layers: transformers passes it) is the config's."""
        if sliding_window and not self.chunked and int(sliding_window) != self.window:
            raise KvcxError(f"KvcxCache {self.spec.describe()}: the model attends over a window of {sliding_window} "
                            "tokens: build the cache from the model's own config (model.config)")

    def _window(self, Q: int, attention_mask: Optional[torch.Tensor]):
        """The step reads from the first position transformers' mask covers (so the mask lines up), or, with no
        mask, from the first token its first query sees; a band mask where the step's tokens see from different
        first tokens (several tokens, or a chunk boundary among them)."""
        end = self.cumulative_length             # after the step's own tokens
        pos0 = end - Q                            # the step's first token
        first = self._first_seen(Q)
        band = None
        if attention_mask is None:
            lo = self._first_visible(np.arange(pos0, end))   # each token's first visible position
            first = int(lo[0])
            if Q > 1 or lo[-1] != first:
                cols = np.arange(first, end)[None, :]
                band = ((cols >= lo[:, None]) & (cols <= np.arange(pos0, end)[:, None]))[None]
        packed_end = self.start + self.store.tokens
        skip = min(max(first - self.start, 0), self.store.tokens)
        rskip = max(first - packed_end, 0)
        return skip, rskip, band

    def _first_visible(self, pos: np.ndarray) -> np.ndarray:
        """The first position a query at each position of ``pos`` sees: its window's or its chunk's."""
        if self.chunked:
            return (pos // self.window) * self.window
        return np.maximum(pos - self.window + 1, 0)

    def pack_residual(self, keep: int = 0) -> None:
        """The tokens no later step can see dropped first (whole packed chunks, or the residual's oldest), then
        the residual's whole multiples of residual_length tokens packed as a full layer packs them."""
        self._forget()
        super().pack_residual(keep)

    def _forget(self) -> None:
        """Drop what no later step reads: tokens before the next step's window (less the last step's tokens,
        which crop() may take back, moving the window back by as many)."""
        lo = self.cumulative_length - self.window + 1 - self.last_step
        if lo <= self.start or self.store is None:
            return
        k, end = 0, self.start
        while k < len(self.store) and end + self.store.chunk_tokens(k) <= lo:
            end += self.store.chunk_tokens(k)
            k += 1
        if k:
            self.start += self.store.drop_chunks(k)
        if self.store.tokens == 0 and self.start < lo:   # nothing packed: the residual's oldest tokens go
            n = min(lo - self.start, self.keys.shape[-2])
            self.keys, self.values = owned(self.keys[:, :, n:]), owned(self.values[:, :, n:])
            self.start += n

    def reset(self) -> None:
        super().reset()
        self.start = 0

    def _croppable(self) -> int:
        """The last step's tokens at most: the window keeps those before it only as far back as they need."""
        return min(self.keys.shape[-2], self.last_step)

    def equivalent_values(self) -> int:
        """Values DynamicSlidingWindowLayer holds for this context: the last ``window - 1`` tokens' keys and
        values."""
        if not self.is_initialized:
            return 0
        B, H = self.keys.shape[:2]
        return B * H * min(self.cumulative_length, self.window - 1) * (self.keys.shape[-1] + self.values.shape[-1])
