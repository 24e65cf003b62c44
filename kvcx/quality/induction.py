"""Retrieval heads found without data, as a plan file: ``kvcx calibrate --guard-induction 3``.

The probe (:mod:`kvcx.cache.induction`: random tokens fed twice, each head scored by how much it copies) ranks the
layers; the plan gives the first ``n`` 8-bit keys (the retrieval guard's plan, :meth:`KVConfig.guarded`), as
:meth:`KvcxCache.for_model <kvcx.cache.KvcxCache.for_model>` does in memory. On SmolLM2-135M the probe's top three
layers are 18, 17 and 20: the layers the measured guard (``--guard-retrieval 8192``, passkey prompts scored layer by
layer) chose from the loss itself.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import List, Optional

import numpy as np

from kvcx.cache.induction import (
    PROBE_SEED,
    PROBE_TOKENS,
    PROBE_TRIALS,
    check_guardable,
    induction_layers,
    induction_scores,
)
from kvcx.cache.layer_types import cached_layers
from kvcx.codecs.kvconfig import KVConfig
from kvcx.codecs.metrics import json_safe
from kvcx.errors import KvcxError

__all__ = ["InductionGuard", "check_induction", "induction_guard", "induction_layers", "induction_scores"]


@dataclass
class InductionGuard:
    """The probe's plan: ``config`` with 8-bit keys in ``layers`` (strongest first), and the scores it ranked
    ([layers, query heads])."""

    config: KVConfig
    layers: List[int]
    scores: np.ndarray
    model: str
    wall_time_s: float

    @property
    def n_layers(self) -> int:
        return int(self.scores.shape[0])

    @property
    def bits_per_value(self) -> float:
        return self.config.bits_per_value(self.n_layers)

    def to_dict(self) -> dict:
        """The plan file's record (``kvcx validate --plan``, ``load_plan``), the probe under ``induction``."""
        return json_safe({"config": self.config.get_config(), "model": self.model, "n_layers": self.n_layers,
                          "bits_per_value": self.bits_per_value, "wall_time_s": self.wall_time_s,
                          "induction": {"layers": self.layers, "scores": self.scores.round(4).tolist(),
                                        "tokens": PROBE_TOKENS, "trials": PROBE_TRIALS, "seed": PROBE_SEED}})


def check_induction(config: KVConfig, n: int = 1) -> None:
    """KvcxError naming the option, before any model loads."""
    if n < 1:
        raise KvcxError(f"--guard-induction {n}: guard at least 1 layer (3 is +0.2 bits/value on a 30-layer model)")
    check_guardable(config, "--guard-induction", "or leave out --guard-induction")


def induction_guard(config: KVConfig, n: int = 3, model: Optional[str] = None, cpu: bool = False,
                    loaded=None) -> InductionGuard:
    """``config`` with 8-bit keys in the ``n`` layers the probe ranks first among those holding keys and values (a
    hybrid's attention layers, as :meth:`KvcxCache.for_model <kvcx.cache.KvcxCache.for_model>` ranks them; module
    docstring); ``loaded``: a (model, tokenizer, name) already loaded, else ``model`` (default: the embedded
    SmolLM2-135M)."""
    t0 = time.perf_counter()
    check_induction(config, n)
    if loaded is None:
        from kvcx.quality.models import load_model_and_tokenizer, resolve_model

        loaded = load_model_and_tokenizer(resolve_model(model), cpu=cpu)
    m, _, name = loaded
    scores = induction_scores(m)
    layers = induction_layers(scores, n, among=[L for L, _ in cached_layers(m.config)])
    return InductionGuard(config=config.guarded(layers), layers=layers, scores=scores, model=name,
                          wall_time_s=time.perf_counter() - t0)
