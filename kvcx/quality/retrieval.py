"""``kvcx validate --task ruler`` (and ``--task passkey``): retrieval at long contexts with the exact cache and
with each setting on the same prompts, judged with statistics.

For each task (:mod:`kvcx.quality.ruler`), context length, depth and prompt: the context's exact cache is built
once (a chunked prefill); the question and the greedy reply attend to it, then to each setting's cache: the
context's cache evicted by the setting's press (if it has one), then packed and unpacked by its codec (if it has
one: the file path's bytes, as ``--mode prefix``). After eviction the question still runs at its own positions
(the context's length onwards): the kept keys carry theirs in their rotary embedding.

Query-agnostic (the default) or query-aware: by default the context is compressed before the question is known,
as a prefix cache (LMCache, vLLM's prefix caching) holds it and as kvpress evaluates its presses; SnapKV's
observation window is then the context's last tokens. ``query_aware=True`` prefills the question with the context
(all but its last token), so the press, SnapKV's window included, sees the question, as SnapKV's paper runs it
on one request; the codec then also packs the question's tokens.

Per task and length, a cell: prompts answered, accuracy with its 95 % Wilson interval, the exact cache's beside
it, and McNemar's exact one-sided test on the paired prompts (:mod:`kvcx.quality.stats`). A task is kept where the
exact cache answers at least half its prompts at some length (a small model cannot do every task; the report
names the tasks dropped and why). A setting passes when no kept cell is significantly below the exact cache,
at family-wise ``alpha`` (0.05) over its kept cells (Holm's adjustment).
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, List, Mapping, Optional, Sequence

from kvcx.codecs.metrics import json_safe
from kvcx.presses import PressedSetting
from kvcx.errors import KvcxError
from kvcx.quality import ranks, ruler, stats
from kvcx.quality.eviction import QueryCapture, attending
from kvcx.quality.scoring import greedy_reply

DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)
KEEP_TASK = 0.5            # a task is kept where the exact cache answers at least this share at some length
MIN_LENGTH = ruler.MIN_LENGTH
HAYSTACK_OFFSET = 300_000  # characters of the dataset text skipped: held out from the perplexity windows


@dataclass
class Cell:
    """One task at one context length: the setting's prompts answered beside the exact cache's, paired."""

    task: str
    length: int
    correct: int
    prompts: int
    accuracy: float
    ci_low: float
    ci_high: float
    exact_correct: int
    exact_accuracy: float
    only_exact: int          # prompts the exact cache answered and the setting did not
    only_setting: int        # prompts the setting answered and the exact cache did not
    p_value: float           # McNemar's exact test, one-sided (setting below exact)
    p_adjusted: float = 1.0  # Holm over the setting's kept cells
    kept: bool = True        # the task is kept (the exact cache does it at some length)
    by_depth: List[dict] = field(default_factory=list)


@dataclass
class RetrievalResult:
    """One setting's retrieval cells beside the exact cache's, and its verdict."""

    setting: str
    task: str
    tasks: List[str]
    dropped: Dict[str, str]
    lengths: List[int]
    depths: List[float]
    prompts: int
    cells: List[Cell]
    alpha: float = stats.ALPHA
    p_value: float = 1.0
    passed: bool = False
    bits_per_value: float = 0.0
    compression_ratio: float = 0.0
    model: str = ""
    device: str = ""
    seed: int = 0
    wall_time_s: float = 0.0
    config: dict = field(default_factory=dict)
    # seconds spent: the exact prefills and answers (shared by every setting), this setting's eviction and codec
    # round trips, its answers
    seconds: dict = field(default_factory=dict)
    query_aware: bool = False  # the question prefilled with the context (the press saw it)

    def verdict_line(self) -> str:
        if not self.tasks:
            return (f"FAILED: {self.task} {self.setting}: no task kept (the exact cache answers under "
                    f"{KEEP_TASK:.0%} of every task's prompts at every length), nothing to gate")
        worst = min((c for c in self.cells if c.kept), key=lambda c: c.p_adjusted)
        word = "PASSED" if self.passed else "FAILED"
        rel = "not significantly below" if self.passed else "significantly below"
        return (f"{word}: {self.task} {self.setting}: {rel} the exact cache (smallest Holm-adjusted p = "
                f"{worst.p_adjusted:.3g} at {worst.task} {worst.length:,}: {worst.correct}/{worst.prompts} vs "
                f"{worst.exact_correct}/{worst.prompts}; alpha {self.alpha})")

    def to_dict(self) -> dict:
        return json_safe(asdict(self))


def check_retrieval(tasks: Sequence[str], lengths: Sequence[int], depths: Sequence[float], prompts: int,
                    context_limit: Optional[int] = None) -> None:
    """KvcxError naming the option and how to fix it, before any model loads."""
    if not tasks:
        raise KvcxError("--tasks names no task; the tasks are " + ", ".join(ruler.TASKS))
    if not lengths:
        raise KvcxError("--lengths names no context length; e.g. --lengths 1024,4096")
    listed = ",".join(map(str, lengths))
    for n in lengths:
        if n < MIN_LENGTH:
            raise KvcxError(f"--lengths {listed}: {n} is shorter than {MIN_LENGTH} tokens; pick longer contexts")
        if context_limit is not None and n > context_limit:
            raise KvcxError(f"--lengths {listed}: {n} exceeds the model's context of {context_limit} tokens; pick "
                            f"lengths up to {context_limit}")
    if len(set(lengths)) != len(lengths):
        raise KvcxError(f"--lengths {listed}: name each length once")
    if not depths or any(not 0.0 <= d <= 1.0 for d in depths):
        raise KvcxError(f"depths {list(depths)}: give fractions of the context, 0..1")
    if prompts < 1:
        raise KvcxError(f"--prompts {prompts} must be at least 1 (prompts per task, length and depth)")


def setting_roundtrip(setting) -> Callable:
    """tensors, queries -> (decoded tensors, bytes stored) for any setting: a press and/or a codec."""
    from kvcx.quality.peers import roundtrip_of

    rt = roundtrip_of(setting)
    if getattr(rt, "query_window", 0):
        return lambda tensors, queries: rt(tensors, queries)[:2]
    return lambda tensors, _queries: rt(tensors)[:2]


def _prompts_in_order(tasks, lengths, depths, prompts: int) -> list:
    """(length, task, depth index, depth, prompt) of every prompt, in the order rank 0 reports them (a task that
    places nothing at a depth: one depth, 0.5)."""
    depth_of = {t: [float(d) for d in depths] if ruler.TASKS[t].uses_depth else [0.5] for t in tasks}
    return [(length, task, j, depth, p) for length in lengths for task in tasks
            for j, depth in enumerate(depth_of[task]) for p in range(prompts)]


def run_retrieval(configs: Mapping[str, object], tasks: Sequence[str], lengths: Optional[Sequence[int]] = None,
                  depths: Sequence[float] = DEPTHS, prompts: int = 2, seed: int = 0, model: Optional[str] = None,
                  dataset_file=None, cpu: bool = False, device=None, alpha: float = stats.ALPHA, on_phase=None,
                  on_prompt: Optional[Callable[[int, int], None]] = None, loaded=None,
                  task_label: str = "ruler", query_aware: bool = False) -> List[RetrievalResult]:
    """The retrieval cells of several settings (label -> KVConfig, peer or PressedSetting) on the same prompts;
    one result per setting. ``lengths`` default to 1,024 doubling up to the model's context."""
    t_start = time.perf_counter()
    if not configs:
        raise KvcxError("no setting to check: give at least one scheme")
    tasks = list(tasks)
    check_retrieval(tasks, lengths or [1024], depths, prompts)
    for cfg in configs.values():
        getattr(cfg, "check_installed", lambda: None)()
    from kvcx.quality.models import (
        load_dataset_text,
        load_model_and_tokenizer,
        resolve_model,
    )

    # the haystack's text read (or its error raised) before the model loads: the needle tasks hide in it
    text = load_dataset_text(dataset_file) if any(ruler.TASKS[t].uses_haystack for t in tasks) else None
    device = ranks.local_device(device, cpu)   # under a launcher on GPUs: the one LOCAL_RANK names
    if lengths:   # fewer prompts than ranks: refused before the model loads (its context gives the default lengths)
        ranks.planned().check_enough(len(_prompts_in_order(tasks, lengths, depths, prompts)), "prompt",
                                     "give more --prompts")
    m, tok, name = loaded if loaded is not None else load_model_and_tokenizer(resolve_model(model), device=device,
                                                                             cpu=cpu)
    import torch

    import copy

    from kvcx.quality.bridge import cache_to_tensors, is_hybrid, rebuilt, tensor_devices
    from kvcx.quality.scoring import forward_hidden

    dev = next(m.parameters()).device
    from kvcx.cache.layer_types import text_config

    limit = int(getattr(text_config(m.config), "max_position_embeddings", 0) or 0) or max(lengths or [1024])
    lengths = list(lengths) if lengths else ruler.default_lengths(limit)
    check_retrieval(tasks, lengths, depths, prompts, limit)
    rank = ranks.join(dev.type)   # under a launcher: rank r answers prompts r, r + N, ... (rank 0 gathers)
    ranks.same_request(rank, {"settings": dict(configs), "tasks": tasks, "lengths": lengths, "depths": list(depths),
                              "prompts": prompts, "seed": seed, "model": name, "text": text, "alpha": alpha,
                              "query_aware": query_aware})
    if not rank.leads:
        on_phase = on_prompt = None

    def encode(text):
        return tok(text, add_special_tokens=False)["input_ids"]

    haystack = None
    if text is not None:
        haystack = ruler.haystack_from(encode, text[HAYSTACK_OFFSET:HAYSTACK_OFFSET + 400_000] or text)
    from kvcx.cache.layer_types import refuse_press
    from kvcx.quality.bridge import model_frame

    if any(isinstance(cfg, PressedSetting) for cfg in configs.values()):   # every layer's copy evicted
        refuse_press(m.config, whole_model=True)
    roundtrips = {label: setting_roundtrip(model_frame(cfg, m)) for label, cfg in configs.items()}
    window = max((cfg.press.window for cfg in configs.values()
                  if isinstance(cfg, PressedSetting) and cfg.press.needs_queries), default=0)
    every = _prompts_in_order(tasks, lengths, depths, prompts)
    rank.check_enough(len(every), "prompt", "give more --prompts")
    mine = rank.shard(list(enumerate(every)))
    total = len(mine)
    if on_phase:
        on_phase(1, 2, f"model: {name} on {dev}; {len(tasks)} task(s) x {len(lengths)} lengths x depths x "
                       f"{prompts} prompts = {len(every)} prompts" +
                       (f"; {rank.size} ranks: rank r answers prompts r, r + {rank.size}, ..." if rank.size > 1 else ""))
    # answers[label] = [(prompt index, answered), ...]: "exact" the exact cache's
    answers: Dict[str, list] = {label: [] for label in ["exact", *configs]}
    sizes = {label: [0, 0] for label in configs}     # bytes stored, values of the full context
    eos, done = getattr(tok, "eos_token_id", None), 0
    spent = {"prefill": 0.0, "exact_answers": 0.0, **{f"{label}:roundtrip": 0.0 for label in configs},
             **{f"{label}:answers": 0.0 for label in configs}}
    clock = time.perf_counter
    with torch.inference_mode():
        for i, (length, task, j, depth, p) in mine:   # this rank's prompts, in order
            prompt = ruler.TASKS[task].build(encode, haystack, length, depth,
                                             ruler.rng_for(seed, task, length, j, p))
            context, question = prompt.context, prompt.question
            if query_aware:   # the question prefilled with the context: the press sees it
                context, question = context + question[:-1], question[-1:]
            ctx = torch.tensor([context], device=dev)
            q = torch.tensor([question], device=dev)
            start = len(context)
            t0 = clock()
            if window:
                with QueryCapture(m, window) as capture:
                    cache = forward_hidden(m, ctx)[1]
                queries = capture.numpy()
            else:
                cache, queries = forward_hidden(m, ctx)[1], None
            tensors = cache_to_tensors(cache)
            devices = tensor_devices(cache)   # each layer's, where the model keeps it (one model over several GPUs)
            template = copy.deepcopy(cache) if is_hybrid(cache) else None   # refilled per setting
            spent["prefill"] += clock() - t0

            def found(tokens, prompt=prompt):
                return prompt.settled(tok.decode(tokens))

            t0 = clock()
            reply = greedy_reply(m, q, cache, prompt.answer_tokens, start, eos, found)
            spent["exact_answers"] += clock() - t0
            answers["exact"].append((i, prompt.answered(tok.decode(reply))))
            del cache
            for label, roundtrip in roundtrips.items():
                t0 = clock()
                decoded, nbytes = roundtrip(tensors, queries)
                sizes[label][0] += nbytes
                sizes[label][1] += sum(a.size for a in tensors.values())
                c = rebuilt(template, decoded, devices)   # layers may hold uneven counts
                del decoded
                t1 = clock()
                with attending(m, c):
                    reply = greedy_reply(m, q, c, prompt.answer_tokens, start, eos, found)
                spent[f"{label}:roundtrip"] += t1 - t0
                spent[f"{label}:answers"] += clock() - t1
                answers[label].append((i, prompt.answered(tok.decode(reply))))
            done += 1
            if on_prompt:
                on_prompt(done, total)
    parts = ranks.gather(rank, (answers, sizes, spent))
    if not rank.leads:   # its answers went to rank 0
        return []
    # outcomes[label][(task, length)] = [(depth, answered), ...] in the prompts' order, from every rank's answers
    outcomes: Dict[str, Dict[tuple, list]] = {label: {} for label in answers}
    for label in answers:
        got = sorted(a for part in parts for a in part[0][label])
        if [i for i, _ in got] != list(range(len(every))):
            raise KvcxError(f"setting {label!r}: the ranks answered {len(got)} of the {len(every)} prompts: a rank "
                            "stopped early; run again")
        for i, ok in got:
            length, task, _, depth, _ = every[i]
            outcomes[label].setdefault((task, length), []).append((depth, ok))
    sizes = {label: [sum(part[1][label][k] for part in parts) for k in (0, 1)] for label in configs}
    spent = {k: sum(part[2][k] for part in parts) for k in spent}
    wall = time.perf_counter() - t_start
    exact = outcomes["exact"]
    dropped = {}
    for task in tasks:
        best = max(sum(a for _, a in exact[(task, n)]) / len(exact[(task, n)]) for n in lengths)
        if best < KEEP_TASK:
            dropped[task] = (f"the exact cache answers at most {best:.0%} of its prompts at any length "
                             f"(under {KEEP_TASK:.0%}): the model cannot do it")
    kept_tasks = [t for t in tasks if t not in dropped]
    if on_phase:
        on_phase(2, 2, f"kept tasks: {', '.join(kept_tasks) or 'none'}" +
                 (f"; dropped: {', '.join(dropped)}" if dropped else ""))
    results = []
    for label, cfg in configs.items():
        cells = [_cell(task, n, exact[(task, n)], outcomes[label][(task, n)], task not in dropped)
                 for task in tasks for n in lengths]
        adjusted = iter(stats.holm([c.p_value for c in cells if c.kept]))
        cells = [dataclasses.replace(c, p_adjusted=next(adjusted)) if c.kept else c for c in cells]
        kept = [c for c in cells if c.kept]
        p_min = min((c.p_adjusted for c in kept), default=1.0)
        stored, values = sizes[label]
        results.append(RetrievalResult(
            setting=label, task=task_label, tasks=kept_tasks, dropped=dropped, lengths=lengths,
            depths=[float(d) for d in depths], prompts=prompts, cells=cells, alpha=alpha, p_value=p_min,
            passed=bool(kept) and p_min >= alpha, bits_per_value=8.0 * stored / values if values else 0.0,
            compression_ratio=16.0 * values / (8.0 * stored) if stored else 0.0, model=name, device=str(dev),
            seed=seed, wall_time_s=wall, config=cfg.get_config(), query_aware=query_aware,
            seconds={"prefill": spent["prefill"], "exact_answers": spent["exact_answers"],
                     "roundtrip": spent[f"{label}:roundtrip"], "answers": spent[f"{label}:answers"]}))
    return results


def _cell(task, length, exact: list, setting: list, kept: bool) -> Cell:
    e = [a for _, a in exact]
    s = [a for _, a in setting]
    p, b, c = stats.mcnemar_below(e, s)
    lo, hi = stats.wilson_interval(sum(s), len(s))
    by_depth = []
    for d in dict.fromkeys(x for x, _ in exact):
        by_depth.append({"depth": d, "correct": sum(a for x, a in setting if x == d),
                         "exact_correct": sum(a for x, a in exact if x == d),
                         "prompts": sum(1 for x, _ in exact if x == d)})
    return Cell(task=task, length=length, correct=sum(s), prompts=len(s), accuracy=sum(s) / len(s), ci_low=lo,
                ci_high=hi, exact_correct=sum(e), exact_accuracy=sum(e) / len(e), only_exact=b, only_setting=c,
                p_value=p, kept=kept, by_depth=by_depth)
