"""The induction probe: the layers whose heads copy, found on random tokens, without data.

A needle is found by heads that copy: attend to an earlier occurrence of the current token and read what followed
it (induction heads; the retrieval heads of long-context studies are among them). They show on any model with random
tokens: a random sequence fed twice, each token of the second copy attends, in such a head, to the token after its
earlier occurrence. The probe scores every head so, in one forward of ``2 x tokens`` random tokens a trial with the
model's eager attention (no dataset, no calibration: 14 s on the embedded model on 2 cores).

:meth:`KvcxCache.for_model <kvcx.cache.KvcxCache.for_model>` gives the layers holding the strongest copying heads
8-bit keys (a tenth of the attention layers: :func:`guard_count`); ``kvcx calibrate --guard-induction N``
(:mod:`kvcx.quality.induction`) writes the same plan to a file. On SmolLM2-135M the probe's top three layers are 18,
17 and 20: the layers the measured guard (``--guard-retrieval 8192``, passkey prompts scored layer by layer) chose
from the loss itself.

torch is imported when the probe runs.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import numpy as np

from kvcx.cache.layer_types import text_config
from kvcx.codecs.intcodec import IntCodec
from kvcx.codecs.widths import WidthCodec
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

    cfg = text_config(model.config)
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


def induction_layers(scores: np.ndarray, n: int, among: Optional[Sequence[int]] = None,
                     option: str = "--guard-induction") -> List[int]:
    """The ``n`` layers holding the highest-scoring heads, strongest first (their keys: the KV heads those heads
    read); ``among``: the layers that may be chosen (default: all; a hybrid's attention layers); ``option``: the
    name the error gives ``n``."""
    among = list(range(scores.shape[0])) if among is None else [int(i) for i in among]
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 1 <= n <= len(among):
        raise KvcxError(f"{option} {n!r}: guard between 1 and the model's {len(among)} attention layers (3 is "
                        "+0.2 bits/value on a 30-layer model)")
    best = scores.max(-1)[among]
    return [among[int(i)] for i in np.argsort(-best, kind="stable")[:n]]


GUARD_SHARE = 10   # a tenth of the attention layers: 3 of SmolLM2's 30 (+0.19 bits/value, the plan measured on
#                    the 8k needle: docs/results/retrieval-passkey-8k-90-for-model.md)


def guard_count(attention_layers: int) -> int:
    """The layers :meth:`KvcxCache.for_model` guards by default: a tenth of the model's attention layers, rounded,
    at least one (on the default scheme each adds (8.25 - 4.5) / 2 bits/value over its share of the layers: +0.19
    bits at a tenth)."""
    return max(1, round(attention_layers / GUARD_SHARE))


def guardable(config) -> bool:
    """Whether the probe's guard applies on top of ``config`` (a :class:`~kvcx.codecs.KVConfig`): a scheme's config
    whose keys are kvcx's integer codes or its widths per channel (kvcx, kvcx3, kvcx2w, kvcx4w, kvcx2v, ...; not a
    plan with per-layer widths, not an engine's format)."""
    return not config.layer_bits and isinstance(config.key, (IntCodec, WidthCodec))


def check_guardable(config, option: str, otherwise: str) -> None:
    """KvcxError where the guard cannot go on top of ``config`` (:func:`guardable`): the one message every way to the
    guard gives, naming its ``option`` and what to do ``otherwise`` instead."""
    if not guardable(config):
        raise KvcxError(f"{option} gives layers 8-bit keys on top of one of kvcx's schemes (kvcx, kvcx3, kvcx2v, ...), "
                        f"but this config is {config.describe()}: pass such a scheme, not a plan or an engine's "
                        f"format, {otherwise}")


def guarded_by_default(config) -> bool:
    """Whether :meth:`KvcxCache.for_model <kvcx.cache.KvcxCache.for_model>` guards ``config`` unasked: where the
    guard was measured to keep the deep needle, a scheme's integer keys (kvcx, ...). Keys of a width per channel take
    the guard when asked (``guard=N``); on kvcx2v it kept no prompt the scheme lost (22/25 either way against the
    exact cache's 25/25: docs/results/retrieval-passkey-8k-90-kvcx2v-guard.md)."""
    return guardable(config) and isinstance(config.key, IntCodec)


def guarded_config(config, layers, attending):
    """``config`` with 8-bit keys in ``layers`` (:meth:`KVConfig.guarded`); KvcxError naming the layer or the scheme
    where it cannot (``attending``: the indices of the layers kvcx packs)."""
    check_guardable(config, "guard_layers", "or leave guard_layers out")
    layers = list(layers)
    for L in layers:
        if isinstance(L, bool) or not isinstance(L, (int, np.integer)) or L not in attending:
            raise KvcxError(f"guard_layers: {L!r} is not a layer this cache packs (the model's attention layers: "
                            f"{', '.join(map(str, attending)) or 'none'}); pass their indices, as "
                            "KvcxCache.for_model's probe finds them")
    if len(set(int(L) for L in layers)) != len(layers):
        raise KvcxError(f"guard_layers {layers}: each layer once")
    return config.guarded(int(L) for L in layers)
