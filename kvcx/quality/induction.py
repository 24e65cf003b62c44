"""Retrieval heads found without data: the induction probe (``kvcx calibrate --guard-induction 3``).

A needle is found by heads that copy: attend to an earlier occurrence of the current token and read what followed
it (induction heads; the retrieval heads of long-context studies are among them). They show on any model with random
tokens: a random sequence fed twice, each token of the second copy attends, in such a head, to the token after its
earlier occurrence. The probe scores every head so, in one forward of ``2 x tokens`` random tokens a trial with the
model's eager attention (no dataset, no calibration, a second on the embedded model), and the layers holding the
strongest copying KV heads get 8-bit keys (the retrieval guard's plan, :meth:`KVConfig.guarded`).

On SmolLM2-135M the probe's top three layers are 18, 17 and 20: the layers the measured guard (``--guard-retrieval
8192``, passkey prompts scored layer by layer) chose from the loss itself.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import List, Optional

import numpy as np

from kvcx.codecs.kvconfig import KVConfig
from kvcx.codecs.metrics import json_safe
from kvcx.errors import KvcxError

PROBE_TOKENS = 512     # the random sequence's length (fed twice); 4 trials of 512 rank SmolLM2's layers the
PROBE_TRIALS = 4       # same for every seed tried (0-2); 2 of 256 swapped its third and fourth (20, 23) by seed
PROBE_SEED = 0


def induction_scores(model, tokens: int = PROBE_TOKENS, trials: int = PROBE_TRIALS, seed: int = PROBE_SEED
                     ) -> np.ndarray:
    """[layers, query heads]: each head's induction score, its mean attention weight from the second copy's tokens to
    the token after their earlier occurrence (0 for a layer that returns no attention weights: a linear-attention
    layer). Random token ids from the middle of the vocabulary (no special tokens)."""
    import torch

    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    vocab, heads, layers = int(cfg.vocab_size), int(cfg.num_attention_heads), int(cfg.num_hidden_layers)
    if tokens < 2 or trials < 1 or vocab < 16:
        raise KvcxError(f"induction probe: tokens={tokens} (at least 2), trials={trials} (at least 1) on a vocabulary "
                        f"of {vocab}")
    g = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    before = getattr(model.config, "_attn_implementation", None)
    model.set_attn_implementation("eager")   # the weights themselves (SDPA and kvcx's attention return none)
    try:
        total = torch.zeros(layers, heads)
        for _ in range(trials):
            seq = torch.randint(vocab // 8, vocab - vocab // 8, (1, tokens), generator=g)
            ids = torch.cat([seq, seq], 1).to(device)
            with torch.no_grad():
                out = model(input_ids=ids, output_attentions=True, use_cache=False)
            where = _attention_layers(cfg, len(out.attentions))
            q = torch.arange(tokens, 2 * tokens, device=device)
            for i, a in zip(where, out.attentions):
                if a is not None:
                    total[i] += a[0][:, q, q - tokens + 1].float().mean(-1).cpu()
    finally:
        if before is not None:
            model.set_attn_implementation(before)
    return (total / trials).numpy()


def _attention_layers(cfg, returned: int) -> List[int]:
    """The layer index of each attention-weights tensor the model returned: every layer's, or where a hybrid returns
    them for its attention layers only (Qwen 3.5's linear layers have none), those of its ``layer_types``."""
    layers = int(cfg.num_hidden_layers)
    if returned == layers:
        return list(range(layers))
    types = list(getattr(cfg, "layer_types", None) or [])
    attending = [i for i, t in enumerate(types) if "linear" not in str(t)]
    if len(types) == layers and len(attending) == returned:
        return attending
    raise KvcxError(f"induction probe: the model returned attention weights of {returned} layers for its {layers}; "
                    "use --guard-retrieval, which measures every layer")


def induction_layers(scores: np.ndarray, n: int) -> List[int]:
    """The ``n`` layers holding the highest-scoring heads, strongest first (their keys: the KV heads those heads
    read)."""
    if not 1 <= n <= scores.shape[0]:
        raise KvcxError(f"--guard-induction {n}: guard between 1 and the model's {scores.shape[0]} layers (3 is "
                        "+0.2 bits/value on a 30-layer model)")
    best = scores.max(-1)
    return [int(i) for i in np.argsort(-best, kind="stable")[:n]]


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
    if config.layer_bits or config.key.takes_weights:
        raise KvcxError("--guard-induction gives layers 8-bit keys on top of a scheme (kvcx, kvcx3, ...): pass a "
                        "scheme whose keys have one width, not a plan, kvcx2w or kvcx4w")


def induction_guard(config: KVConfig, n: int = 3, model: Optional[str] = None, cpu: bool = False,
                    loaded=None) -> InductionGuard:
    """``config`` with 8-bit keys in the ``n`` layers the probe ranks first (module docstring); ``loaded``: a
    (model, tokenizer, name) already loaded, else ``model`` (default: the embedded SmolLM2-135M)."""
    t0 = time.perf_counter()
    check_induction(config, n)
    if loaded is None:
        from kvcx.quality.models import load_model_and_tokenizer, resolve_model

        loaded = load_model_and_tokenizer(resolve_model(model), cpu=cpu)
    m, _, name = loaded
    scores = induction_scores(m)
    layers = induction_layers(scores, n)
    return InductionGuard(config=config.guarded(layers), layers=layers, scores=scores, model=name,
                          wall_time_s=time.perf_counter() - t0)
