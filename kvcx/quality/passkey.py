"""The passkey grid of ``bench/bench_passkey.py`` (lengths x depths, a tolerance per length): does the model still
find a key hidden in a long context once the context's cache is compressed? (``kvcx validate --task passkey``
runs the passkey task of :mod:`kvcx.quality.ruler` through :func:`kvcx.quality.retrieval.run_retrieval`, judged by
a paired test instead of a tolerance.)

Perplexity averages over every token; retrieval asks one token-exact question of one place in a long context,
which is where low-bit caches are known to break first (an int4 quantized cache answering 0 of 120 prompts its
FP16 cache answers 98 of). The task is the passkey test of Mohtashami & Jaggi (2023), as long-context papers
run it: a five-digit key hidden at a depth of the context in repeated filler text, then the question. For each
context length and depth, ``prompts`` prompts with different keys (seeded: the same prompts for every setting
and every run). The prompt up to the question is the context: its exact cache is built once, then each setting
compresses that cache through its codec and file format (as ``--mode prefix``); the question and the greedy
answer attend to the exact and to each compressed cache in turn. A prompt is answered when the answer's first
number is the key.

A setting passes when at every length it answers at most ``tolerance`` prompts fewer than the exact cache (the
exact cache's own accuracy is measured, not assumed: a small model misses some prompts with any cache).
"""
from __future__ import annotations

import re
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, List, Mapping, Optional, Sequence

import numpy as np

from kvcx.codecs.kvconfig import KVConfig
from kvcx.codecs.metrics import json_safe
from kvcx.errors import KvcxError

from kvcx.quality.ruler import (ANSWER_TOKENS, FILLER, INTRO, MIN_LENGTH, NEEDLE,  # noqa: F401 - the passkey
                                 QUESTION, build_passkey_prompt as build_prompt, default_lengths)   # prompt
DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)

PromptCallback = Callable[[int, int], None]


def check_passkey(lengths: Sequence[int], depths: Sequence[float], prompts: int, tolerance: int,
                  context_limit: Optional[int] = None) -> None:
    if not lengths or not depths:
        raise KvcxError("lengths= and depths= must name at least one context length and one depth")
    listed = ",".join(map(str, lengths))
    for n in lengths:
        if n < MIN_LENGTH:
            raise KvcxError(f"lengths={listed}: {n} is shorter than {MIN_LENGTH} tokens; pick longer contexts")
        if context_limit is not None and n > context_limit:
            raise KvcxError(f"lengths={listed}: {n} exceeds the model's context of {context_limit} tokens")
    if len(set(lengths)) != len(lengths):
        raise KvcxError(f"lengths={listed}: name each length once")
    if any(not 0.0 <= d <= 1.0 for d in depths):
        raise KvcxError(f"depths={','.join(map(str, depths))}: depths are fractions of the context, 0..1")
    if prompts < 1:
        raise KvcxError(f"prompts={prompts} must be at least 1 (prompts per length and depth)")
    if tolerance < 0:
        raise KvcxError(f"tolerance={tolerance} must be >= 0 (prompts a setting may miss beyond the exact cache)")


def passkey_key(seed: int, length: int, depth_index: int, prompt: int) -> int:
    """The five-digit key of one prompt: the same for every setting, run and machine."""
    return int(np.random.default_rng([seed, length, depth_index, prompt]).integers(10000, 100000))


def answer_of(decode: Callable[[List[int]], str], tokens: List[int]) -> Optional[int]:
    m = re.search(r"\d+", decode(tokens))
    return int(m.group(0)) if m else None


def greedy_answer(model, question, cache, n_tokens: int = ANSWER_TOKENS) -> List[int]:
    """The model's greedy continuation of ``question`` [1, Q] over ``cache`` (which it extends)."""
    import torch

    from kvcx.quality.scoring import forward_hidden, output_logits

    tokens, step = [], question
    for _ in range(n_tokens):
        hidden, cache = forward_hidden(model, step, cache)
        nxt = int(output_logits(model, hidden[-1:]).argmax(-1))
        tokens.append(nxt)
        step = torch.tensor([[nxt]], device=question.device)
    return tokens


@dataclass
class PasskeyResult:
    """One setting's answers beside the exact cache's on the same prompts: ``exact[i][j]`` and
    ``compressed[i][j]`` count the prompts of length ``lengths[i]`` and depth ``depths[j]`` answered."""

    setting: str
    lengths: List[int]
    depths: List[float]
    prompts: int
    exact: List[List[int]]
    compressed: List[List[int]]
    tolerance: int
    passed: bool = False
    bits_per_value: float = 0.0
    compression_ratio: float = 0.0
    model: str = ""
    device: str = ""
    seed: int = 0
    wall_time_s: float = 0.0
    config: dict = field(default_factory=dict)
    task: str = "passkey"

    def per_length(self) -> List[tuple]:
        """(length, exact answered, compressed answered, prompts) per length."""
        n = self.prompts * len(self.depths)
        return [(L, sum(e), sum(c), n) for L, e, c in zip(self.lengths, self.exact, self.compressed)]

    def verdict_line(self) -> str:
        worst = max((e - c for _, e, c, _ in self.per_length()), default=0)
        word = "PASSED" if self.passed else "FAILED"
        return (f"{word}: passkey {self.setting}: at most {max(worst, 0)} prompt(s) fewer than the exact cache at "
                f"any length ({'<=' if self.passed else '>'} tolerance {self.tolerance})")

    def to_dict(self) -> dict:
        return json_safe(asdict(self))


def run_passkey(configs: Mapping[str, KVConfig], lengths: Optional[Sequence[int]] = None,
                depths: Sequence[float] = DEPTHS, prompts: int = 2, tolerance: int = 1, seed: int = 0,
                model: Optional[str] = None, cpu: bool = False, device=None, on_phase=None,
                on_prompt: Optional[PromptCallback] = None, roundtrips: Optional[Mapping[str, Callable]] = None,
                loaded=None) -> List[PasskeyResult]:
    """The passkey table of several settings (label -> KVConfig) on the same prompts; one result per setting.

    ``lengths``: context lengths in tokens (default: 1,024 doubling up to the model's context); ``depths``:
    where the key sits, as fractions of the context; ``prompts``: prompts per length and depth; ``loaded`` =
    (model, tokenizer, name) skips loading; ``roundtrips`` replace a setting's codec round trip (by label)."""
    t_start = time.perf_counter()
    if not configs:
        raise KvcxError("no setting to check: give at least one scheme")
    check_passkey(lengths or [1024], depths, prompts, tolerance)
    for cfg in configs.values():
        getattr(cfg, "check_installed", lambda: None)()
    from kvcx.quality.models import load_model_and_tokenizer, resolve_model

    m, tok, name = loaded if loaded is not None else load_model_and_tokenizer(resolve_model(model), device=device,
                                                                             cpu=cpu)
    import torch

    import copy

    from kvcx.quality.bridge import cache_to_tensors, is_hybrid, rebuilt
    from kvcx.quality.peers import roundtrip_of
    from kvcx.quality.scoring import forward_hidden

    dev = next(m.parameters()).device
    limit = int(getattr(m.config, "max_position_embeddings", 0) or 0) or max(lengths or [1024])
    lengths = list(lengths) if lengths else default_lengths(limit)
    depths = [float(d) for d in depths]
    check_passkey(lengths, depths, prompts, tolerance, limit)
    roundtrips = {label: (roundtrips or {}).get(label) or roundtrip_of(cfg, m.config) for label, cfg in configs.items()}
    if on_phase:
        on_phase(1, 2, f"model: {name} on {dev}; {len(lengths)} lengths x {len(depths)} depths x {prompts} prompts")

    def encode(text):
        return tok(text, add_special_tokens=False)["input_ids"]

    shape = (len(lengths), len(depths))
    exact = np.zeros(shape, dtype=int)
    comp = {label: np.zeros(shape, dtype=int) for label in configs}
    sizes = {label: [0, 0] for label in configs}   # packed bytes, values
    total, done = len(lengths) * len(depths) * prompts, 0
    with torch.inference_mode():
        for i, length in enumerate(lengths):
            for j, depth in enumerate(depths):
                for p in range(prompts):
                    key = passkey_key(seed, length, j, p)
                    context, question = build_prompt(encode, length, depth, key)
                    q = torch.tensor([question], device=dev)
                    cache = forward_hidden(m, torch.tensor([context], device=dev))[1]
                    tensors = cache_to_tensors(cache)
                    template = copy.deepcopy(cache) if is_hybrid(cache) else None
                    exact[i, j] += answer_of(tok.decode, greedy_answer(m, q, cache)) == key
                    del cache
                    for label, roundtrip in roundtrips.items():
                        decoded, nbytes, _ = roundtrip(tensors)
                        sizes[label][0] += nbytes
                        sizes[label][1] += sum(a.size for a in tensors.values())
                        c = rebuilt(template, decoded, dev)
                        del decoded
                        comp[label][i, j] += answer_of(tok.decode, greedy_answer(m, q, c)) == key
                    done += 1
                    if on_prompt:
                        on_prompt(done, total)
    if on_phase:
        on_phase(2, 2, f"answered by the exact cache: {int(exact.sum())} of {total} prompts")
    wall = time.perf_counter() - t_start
    results = []
    for label, cfg in configs.items():
        lost = (exact.sum(1) - comp[label].sum(1)).max()
        packed, values = sizes[label]
        results.append(PasskeyResult(
            setting=label, lengths=lengths, depths=depths, prompts=prompts, exact=exact.tolist(),
            compressed=comp[label].tolist(), tolerance=tolerance, passed=bool(lost <= tolerance),
            bits_per_value=8.0 * packed / values if values else 0.0,
            compression_ratio=2.0 * values / packed if packed else 0.0, model=name, device=str(dev), seed=seed,
            wall_time_s=wall, config=cfg.get_config()))
    return results
