"""Retrieval tasks generated from templates, as RULER (Hsieh et al. 2024, NVIDIA/RULER) makes them: no download,
a seed, and the haystack from the dataset text.

Each task builds one prompt from (length, depth, prompt index, seed): the context (what is cached, compressed,
evicted) and the question after it (which attends to that cache), and the answers a correct reply contains. A
prompt counts as answered when every answer appears in the greedy reply (RULER's ``string_match_all``, taken
per prompt as all-or-nothing, so that a cell is a count of prompts and gets a binomial interval).

- ``passkey``: the passkey test (Mohtashami & Jaggi 2023) in its filler text (:func:`build_passkey_prompt`);
- ``niah_single``: one needle ("One of the special magic numbers for {key} is: {value}.") in the dataset text,
  the question asks for the key's number;
- ``niah_multikey``: that needle among 3 distractor needles with other keys;
- ``niah_multivalue``: 4 needles with the same key and different numbers: all four asked;
- ``niah_multiquery``: 4 needles with different keys: all four keys asked at once;
- ``vt``: variable tracking: a chain ``VAR A = 12345``, ``VAR B = VAR A``, ... (4 hops) spread through
  filler text; every variable holding the number asked;
- ``cwe``: common word extraction: a numbered list where 10 words appear 30 times and the others 3 times;
  the 10 frequent ones asked (depth does not apply: one position).

The needle's depth is where the queried needle sits (fraction of the context); distractors and other needles
sit at seeded random depths. Values are 7-digit numbers, keys and variables drawn from fixed word lists: the
same prompts on every machine and for every setting.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Dict, List, Sequence

import numpy as np

from kvcx.errors import KvcxError

Encode = Callable[[str], List[int]]

WORDS = tuple("""apple anchor badge basket beacon blanket bottle bracket breeze bridge bucket butter cabin candle
canvas carpet castle cedar chalk channel cherry circle cliff clover cobalt comet copper cotton crystal curtain
dagger desert diamond dolphin dragon drum eagle ember engine falcon feather fender ferry fiddle flame forest
fossil fountain garden garnet ginger glacier goblet granite gravel harbor harvest hammer helmet hollow honey
island ivory jacket jasmine jungle kettle kernel ladder lagoon lantern lemon lilac linen lizard magnet maple
marble meadow mirror mitten monkey mosaic needle nickel oasis orchid otter paddle pepper pebble pillar pine
planet pocket pony prism puzzle quartz quill rabbit raven ribbon river rocket saddle salmon satin shadow shell
silver sparrow spider spruce statue summit tablet thistle thunder timber tulip tunnel velvet violet walnut
willow window winter wizard zebra""".split())
FILLER = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
# the passkey test's prompt (Mohtashami & Jaggi 2023)
INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
         "I will quiz you about the important information there.")
NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = " What is the pass key? The pass key is"
ANSWER_TOKENS = 8
MIN_LENGTH = 256


@dataclass
class Prompt:
    """One generated prompt: the context's and the question's token ids, and the strings a reply must contain."""

    context: List[int]
    question: List[int]
    answers: List[str]
    answer_tokens: int

    def answered(self, reply: str) -> bool:
        return all(_found(a, reply) for a in self.answers)

    def settled(self, partial: str) -> bool:
        """True once a partial reply holds every answer followed by a character that ends it: whatever the
        reply goes on to say, it is answered (a number at the very end might still grow a digit)."""
        return all(_found(a, partial, closed=True) for a in self.answers)


def _found(answer: str, reply: str, closed: bool = False) -> bool:
    """``answer`` in ``reply`` as a whole word or number (12345 is not found inside 123456); ``closed``: followed
    by a character, not by the end of the reply."""
    end = r"(?=[^0-9A-Za-z])" if closed else r"(?![0-9A-Za-z])"
    return re.search(r"(?<![0-9A-Za-z])" + re.escape(answer) + end, reply) is not None


@dataclass(frozen=True)
class Task:
    """A registered task: its builder, whether it sweeps depths and whether it hides in the dataset's text."""

    name: str
    build: Callable[..., Prompt]
    uses_depth: bool = True
    uses_haystack: bool = True


TASKS: Dict[str, Task] = {}


def register_task(name: str, uses_depth: bool = True, uses_haystack: bool = True):
    def deco(fn):
        TASKS[name] = Task(name, fn, uses_depth, uses_haystack)
        return fn
    return deco


def rng_for(seed: int, task: str, length: int, depth_index: int, prompt: int) -> np.random.Generator:
    """The generator of one prompt: the same for every setting, run and machine."""
    salt = sum((i + 1) * ord(c) for i, c in enumerate(task))
    return np.random.default_rng([seed, salt, length, depth_index, prompt])


def _number(rng) -> str:
    return str(int(rng.integers(1_000_000, 10_000_000)))


def _keys(rng, n: int) -> List[str]:
    """``n`` distinct two-word keys (``copper-lantern``)."""
    keys: List[str] = []
    while len(keys) < n:
        a, b = rng.choice(len(WORDS), 2, replace=False)
        key = f"{WORDS[a]}-{WORDS[b]}"
        if key not in keys:
            keys.append(key)
    return keys


def _fit(encode: Encode, length: int, head: str, question: str, answer_tokens: int, what: str):
    h, q = encode(head), encode(question)
    room = length - answer_tokens - len(h) - len(q)
    if room < 64:
        raise KvcxError(f"a context of {length} tokens has no room for the {what} prompt; use longer lengths")
    return h, q, room


def _room_left(room: int, pieces: Sequence[List[int]], length: int, what: str) -> int:
    """Tokens of haystack left once ``pieces`` are placed, or KvcxError where fewer than 64 are."""
    left = room - sum(map(len, pieces))
    if left < 64:
        raise KvcxError(f"a context of {length} tokens has no room for the {what} prompt; use longer lengths")
    return left


def _placed(depths: Sequence[float], pieces: Sequence[List[int]], head: int, hay: int) -> list:
    """(fraction of the haystack, piece) for pieces wanted at ``depths`` of the whole context (the introduction
    of ``head`` tokens included), as near as the introduction allows."""
    total = head + hay + sum(map(len, pieces))
    return [(min(max((d * total - head) / hay, 0.0), 1.0), p) for d, p in zip(depths, pieces)]


def _insert(haystack: List[int], pieces: Sequence[tuple]) -> List[int]:
    """``haystack`` with each (fraction, token ids) inserted at that fraction of it, in order of position."""
    out, last = [], 0
    for frac, ids in sorted(pieces, key=lambda p: p[0]):
        at = min(max(int(round(frac * len(haystack))), last), len(haystack))
        out += haystack[last:at] + ids
        last = at
    return out + haystack[last:]


def _niah(encode, haystack, length, depth, rng, n_keys=1, n_values=1, n_queries=1) -> Prompt:
    keys = _keys(rng, max(n_keys, n_queries))
    needles = [(keys[0], _number(rng)) for _ in range(n_values)] + [(k, _number(rng)) for k in keys[1:]]
    asked = keys[:n_queries]
    kind = "numbers"
    head = (f"Some special magic {kind} are hidden within the following text. Make sure to memorize it. I will quiz "
            f"you about the {kind} afterwards.\n")
    query = ", ".join(asked[:-1]) + (" and " if len(asked) > 1 else "") + asked[-1]
    question = (f"\nWhat are all the special magic {kind} for {query} mentioned in the provided text? The special "
                f"magic {kind} for {query} mentioned in the provided text are")
    answers = [v for k, v in needles if k in asked]
    answer_tokens = 12 * len(answers) + 4
    h, q, room = _fit(encode, length, head, question, answer_tokens, "needle")
    ids = [encode(f" One of the special magic {kind} for {k} is: {v}.") for k, v in needles]
    hay = haystack(_room_left(room, ids, length, "needle"), rng)
    # the first needle (the queried key's) at the depth; the others (distractors, more values, more keys) at
    # seeded depths
    depths = [depth] + [float(rng.uniform(0.05, 0.95)) for _ in needles[1:]]
    return Prompt(h + _insert(hay, _placed(depths, ids, len(h), len(hay))), q, answers, answer_tokens)


@register_task("niah_single")
def niah_single(encode, haystack, length, depth, rng) -> Prompt:
    return _niah(encode, haystack, length, depth, rng)


@register_task("niah_multikey")
def niah_multikey(encode, haystack, length, depth, rng) -> Prompt:
    return _niah(encode, haystack, length, depth, rng, n_keys=4)


@register_task("niah_multivalue")
def niah_multivalue(encode, haystack, length, depth, rng) -> Prompt:
    return _niah(encode, haystack, length, depth, rng, n_values=4)


@register_task("niah_multiquery")
def niah_multiquery(encode, haystack, length, depth, rng) -> Prompt:
    return _niah(encode, haystack, length, depth, rng, n_queries=4)


@register_task("vt", uses_haystack=False)
def variable_tracking(encode, haystack, length, depth, rng, hops: int = 4) -> Prompt:
    names = ["".join(chr(ord("A") + int(x)) for x in rng.integers(0, 26, 5)) for _ in range(hops + 1)]
    value = str(int(rng.integers(10000, 100000)))
    chain = [f" VAR {names[0]} = {value}."] + [f" VAR {names[i]} = VAR {names[i - 1]}." for i in range(1, hops + 1)]
    head = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n"
    question = (f"\nQuestion: Find all variables that are assigned the value {value} in the text above. Answer: "
                f"According to the chain(s) of variable assignment in the text above, {hops + 1} variables are "
                f"assigned the value {value}, they are:")
    answer_tokens = 8 * (hops + 1) + 4
    h, q, room = _fit(encode, length, head, question, answer_tokens, "variable tracking")
    ids = [encode(s) for s in chain]
    filler = encode(FILLER)
    n = _room_left(room, ids, length, "variable tracking")
    hay = (filler * (1 + n // len(filler)))[:n]
    # the chain from the depth onwards, in order: its first link at the depth, the rest spread after it
    span = 1.0 - depth
    places = [depth + span * i / (hops + 1) for i in range(hops + 1)]
    return Prompt(h + _insert(hay, _placed(places, ids, len(h), len(hay))), q, names, answer_tokens)


@register_task("cwe", uses_depth=False, uses_haystack=False)
def common_words(encode, haystack, length, depth, rng, common: int = 10) -> Prompt:
    order = rng.permutation(len(WORDS))
    frequent, rare_pool = [WORDS[i] for i in order[:common]], [WORDS[i] for i in order[common:]]
    head = ("Below is a numbered list of words. In these words, some appear more often than others. Memorize the "
            "ones that appear most often.\n")
    question = (f"\nQuestion: What are the {common} most common words in the above list? Answer: The top {common} "
                "words that appear most often in the list are:")
    answer_tokens = 4 * common + 8
    h, q, room = _fit(encode, length, head, question, answer_tokens, "common words")
    # RULER's proportions (30 and 3 appearances) where the context holds them, fewer where it does not; the list
    # filled with rare words up to the room (the frequent ones never cut)
    cost = sum(len(encode(f" {999}. {w}")) for w in WORDS) / len(WORDS)
    fits = int(room // cost)
    freq_common = min(30, fits // (2 * common))
    if freq_common < 2:
        raise KvcxError(f"a context of {length} tokens has no room for the common words prompt; use longer lengths")
    freq_rare = max(1, freq_common // 10)
    rare = [w for w in rare_pool for _ in range(freq_rare)]
    most = int(room // min(len(encode(f" {1}. {w}")) for w in WORDS))     # more than fit: trimmed below
    rare = (rare * (1 + most // max(len(rare), 1)))[:max(most - common * freq_common, 0)]
    words = [w for w in frequent for _ in range(freq_common)] + rare
    words = [words[i] for i in rng.permutation(len(words))]
    while True:
        body = [t for i, w in enumerate(words) for t in encode(f" {i + 1}. {w}")]
        over = len(body) - room
        if over <= 0:
            break
        drop = set()                                  # the last rare entries, enough to save the excess
        for i in range(len(words) - 1, -1, -1):
            if words[i] not in frequent:
                drop.add(i)
                if (len(drop) * cost >= over) if over > 4 * cost else True:    # near the room: one at a time
                    break
        words = [w for i, w in enumerate(words) if i not in drop]
    return Prompt(h + body, q, frequent, answer_tokens)


def task_names(spec: str) -> List[str]:
    """``ruler`` -> every RULER task; else a comma-separated list of task names, each checked."""
    if spec.strip().lower() == "ruler":
        return [t for t in TASKS if t != "passkey"]
    names = [x.strip() for x in spec.split(",") if x.strip()]
    unknown = [x for x in names if x not in TASKS]
    if unknown or not names:
        raise KvcxError(f"--tasks {spec!r}: {', '.join(map(repr, unknown)) or 'nothing'} is not a task; the tasks are "
                        f"{', '.join(TASKS)} (or ruler for all but passkey)")
    if len(set(names)) != len(names):
        raise KvcxError(f"--tasks {spec!r}: name each task once")
    return names


def default_lengths(context_limit: int) -> List[int]:
    """1,024, 2,048, 4,096, ... up to the model's context (the limit itself last)."""
    lengths, n = [], 1024
    while n < context_limit:
        lengths.append(n)
        n *= 2
    return lengths + [context_limit]


def build_passkey_prompt(encode: Encode, length: int, depth: float, key: int) -> tuple:
    """(context token ids, question token ids) of one passkey prompt: ``length`` tokens in all with the answer's
    room, the key's sentence between filler sentences at ``depth`` of the context (as near as the introduction
    and the filler's sentences allow)."""
    intro, filler, needle, question = (encode(x) for x in (INTRO, FILLER, NEEDLE.format(key=key), QUESTION))
    room = length - ANSWER_TOKENS - len(intro) - len(needle) - len(question)
    if room < len(filler):
        raise KvcxError(f"a context of {length} tokens has no room for the passkey prompt; use longer lengths")
    units = room // len(filler)
    total = len(intro) + units * len(filler) + len(needle)
    at = min(max(int(round((depth * total - len(intro)) / len(filler))), 0), units)
    context = intro + filler * at + needle + filler * (units - at)
    return context, question


@register_task("passkey", uses_haystack=False)
def passkey_task(encode, haystack, length, depth, rng) -> Prompt:
    key = int(rng.integers(10000, 100000))
    context, question = build_passkey_prompt(encode, length, depth, key)
    return Prompt(context, question, [str(key)], ANSWER_TOKENS)


def haystack_from(encode: Encode, text: str) -> Callable[..., List[int]]:
    """A function giving ``n`` tokens of the dataset text (tokenized once) for a prompt's generator."""
    ids = encode(text)
    if not ids:
        raise KvcxError("the dataset text is empty; give --dataset-file a WikiText-2 raw file")

    def take(n: int, rng) -> List[int]:
        """``n`` tokens of the text from a seeded place in it (wrapping round where the text is short)."""
        n = max(n, 0)
        start = int(rng.integers(0, len(ids)))
        return (ids[start:] + ids * (1 + n // len(ids)))[:n]
    return take
