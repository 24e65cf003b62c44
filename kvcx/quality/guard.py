"""The retrieval guard (``kvcx calibrate --guard-retrieval 8192``): which layers' keys carry a codec's loss on
long-context retrieval, and the plan that gives those keys 8 bits.

Perplexity scores every token; a needle is a few. On SmolLM2-135M at 8,192 tokens the default codec loses the
passkey at 90 % depth on some prompts the exact cache answers (19/25 on fresh prompts, McNemar p = 0.016), and
the loss is the needle's own keys in a few layers: keys exact answer 25/25, values exact 19/25, the needle's
tokens exact 25/25, and the keys of layers 17, 18 and 20 carry it (docs/results/retrieval-loss-8k.md). Which
layers is the model's, not the codec's, so the guard measures them for the model at hand:

for ``prompts`` passkey prompts at ``length`` tokens (their own seed: not the prompts `validate` gates on), the
exact cache's greedy reply is scored teacher-forced (its summed log-probability) over the exact cache, over the
cache with every layer coded, and over the exact cache with one layer's keys coded, for every layer. A layer is
guarded where its keys alone lose at least ``protect`` (15 %) of what every layer coded loses; its keys get 8
bits (+4 bits a key value in that layer: +0.067 bits/value a layer on a 30-layer model).
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Callable, List, Optional, Sequence

from kvcx.cache.induction import check_guardable
from kvcx.codecs.kvconfig import GUARD_BITS, KVConfig
from kvcx.codecs.metrics import json_safe
from kvcx.errors import KvcxError
from kvcx.quality import ranks, ruler

PROTECT = 0.15
GUARD_SEED = 1000          # the guard's prompts: not validate's (seed 0 by default)
GUARD_DEPTHS = (0.9,)


@dataclass
class Guard:
    """What the guard measured and the config it gives: ``losses[i]`` the mean log-probability lost with layer
    ``i``'s keys alone coded, ``whole`` with every layer coded (nats over the reply), ``layers`` the guarded."""

    config: KVConfig
    layers: List[int]
    losses: List[float]
    whole: float
    protect: float
    length: int
    depths: List[float]
    prompts: int
    seed: int
    model: str
    wall_time_s: float

    @property
    def n_layers(self) -> int:
        return len(self.losses)

    @property
    def bits_per_value(self) -> float:
        return self.config.bits_per_value(self.n_layers)

    def to_dict(self) -> dict:
        """The plan file's record (``kvcx validate --plan``, ``load_plan``), the measurement under ``guard``."""
        measured = {k: v for k, v in asdict(self).items() if k not in ("config", "model", "wall_time_s")}
        return json_safe({"config": self.config.get_config(), "model": self.model, "n_layers": self.n_layers,
                          "bits_per_value": self.bits_per_value, "wall_time_s": self.wall_time_s, "guard": measured})


def guarded_layers(losses: Sequence[float], whole: float, protect: float = PROTECT) -> List[int]:
    """The layers whose loss alone is at least ``protect`` of ``whole`` (none when ``whole`` shows no loss)."""
    if not 0.0 < protect <= 1.0:
        raise KvcxError(f"protect={protect} must be a share of the loss in (0, 1]")
    if not whole > 0:
        return []
    return [i for i, x in enumerate(losses) if x >= protect * whole]


def guard_config(config: KVConfig, layers: Sequence[int]) -> KVConfig:
    """``config`` with 8-bit keys in ``layers`` (their values as the config gives them)."""
    return config.guarded(layers, GUARD_BITS)


def check_guard(config: KVConfig, length: int, prompts: int, depths: Sequence[float], protect: float) -> None:
    """KvcxError naming the option, before any model loads."""
    if ranks.launched():   # every rank would answer every prompt and write the same plan
        raise KvcxError("--guard-retrieval runs in one process: start it without torchrun / accelerate launch (the "
                        "windows of kvcx calibrate --budget and kvcx validate, and validate's prompts, shard)")
    check_guardable(config, "--guard-retrieval", "or leave out --guard-retrieval")
    if length < ruler.MIN_LENGTH:
        raise KvcxError(f"--guard-retrieval {length}: contexts of at least {ruler.MIN_LENGTH} tokens; measure at the "
                        "length you serve, e.g. 8192")
    if prompts < 1:
        raise KvcxError(f"--prompts {prompts} must be at least 1")
    if not depths or any(not 0.0 <= d <= 1.0 for d in depths):
        raise KvcxError(f"depths {list(depths)}: give fractions of the context, 0..1")
    guarded_layers([], 1.0, protect)


def _reply_logp(decoder, model, layers, question: List[int], reply: List[int], start: int) -> float:
    """The summed log-probability of ``reply`` after ``question`` over a cache of ``layers`` [(key, value)]."""
    import torch

    from kvcx.deps import cache_keyword
    from kvcx.quality.bridge import make_dynamic_cache
    from kvcx.quality.scoring import output_logits

    ids = torch.tensor([question + reply[:-1]])
    positions = torch.arange(start, start + ids.shape[1])[None]
    hidden = decoder(input_ids=ids, position_ids=positions, use_cache=True,
                     **{cache_keyword(decoder.forward): make_dynamic_cache(layers)}).last_hidden_state[0]
    logp = torch.log_softmax(output_logits(model, hidden[len(question) - 1:]).float(), -1)
    return float(logp[torch.arange(len(reply)), torch.tensor(reply)].sum())


def measure_guard(config: KVConfig, length: int = 8192, prompts: int = 8, depths: Sequence[float] = GUARD_DEPTHS,
                  seed: int = GUARD_SEED, protect: float = PROTECT, model: Optional[str] = None, cpu: bool = False,
                  loaded=None, on_prompt: Optional[Callable[[int, int], None]] = None) -> Guard:
    """Measure each layer's keys on passkey prompts and guard the layers that carry the loss (module docstring)."""
    t0 = time.perf_counter()
    depths = [float(d) for d in depths]
    check_guard(config, length, prompts, depths, protect)
    from kvcx.quality.models import load_model_and_tokenizer, resolve_model

    m, tok, name = loaded if loaded is not None else load_model_and_tokenizer(resolve_model(model), cpu=cpu)
    from kvcx.cache.layer_types import text_config

    text_cfg = text_config(m.config)   # a multimodal class (Gemma 3/4): its decoder's
    limit = int(getattr(text_cfg, "max_position_embeddings", 0) or 0)
    if limit and length > limit:
        raise KvcxError(f"--guard-retrieval {length} exceeds the model's context of {limit} tokens; pick up to {limit}")
    import numpy as np
    import torch

    from kvcx.deps import decoder_of
    from kvcx.quality.bridge import cache_to_tensors
    from kvcx.quality.peers import roundtrip_of
    from kvcx.quality.scoring import forward_hidden, greedy_reply

    n_layers = int(text_cfg.num_hidden_layers)
    decoder = decoder_of(m)
    roundtrip = roundtrip_of(config)
    eos = getattr(tok, "eos_token_id", None)
    lost_whole, lost = [], [[] for _ in range(n_layers)]
    total, done = len(depths) * prompts, 0

    def encode(text):
        return tok(text, add_special_tokens=False)["input_ids"]

    def pairs(tensors):
        return [tuple(torch.from_numpy(tensors[f"layer_{i}_{k}"]) for k in ("key", "value")) for i in range(n_layers)]

    with torch.inference_mode():
        for j, depth in enumerate(depths):
            for p in range(prompts):
                prompt = ruler.TASKS["passkey"].build(encode, None, length, depth,
                                                      ruler.rng_for(seed, "passkey", length, j, p))
                cache = forward_hidden(m, torch.tensor([prompt.context]))[1]
                exact = cache_to_tensors(cache)
                start = len(prompt.context)
                reply = greedy_reply(m, torch.tensor([prompt.question]), cache, prompt.answer_tokens, start, eos,
                                     lambda t, prompt=prompt: prompt.settled(tok.decode(t)))
                del cache
                coded = roundtrip(exact)[0]
                exact_pairs, coded_pairs = pairs(exact), pairs(coded)
                base = _reply_logp(decoder, m, exact_pairs, prompt.question, reply, start)
                lost_whole.append(base - _reply_logp(decoder, m, coded_pairs, prompt.question, reply, start))
                for i in range(n_layers):
                    mixed = list(exact_pairs)
                    mixed[i] = (coded_pairs[i][0], exact_pairs[i][1])
                    lost[i].append(base - _reply_logp(decoder, m, mixed, prompt.question, reply, start))
                done += 1
                if on_prompt:
                    on_prompt(done, total)
    losses = [float(np.mean(x)) for x in lost]
    whole = float(np.mean(lost_whole))
    layers = guarded_layers(losses, whole, protect)
    return Guard(config=guard_config(config, layers), layers=layers, losses=losses, whole=whole, protect=protect,
                 length=length, depths=depths, prompts=prompts, seed=seed, model=name,
                 wall_time_s=time.perf_counter() - t0)
