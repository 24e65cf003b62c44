"""What ``kvcx validate`` is asked, checked in one place before any model loads: which task, and which options go
with it. The command builds a :class:`ValidateRequest` from its flags and calls :meth:`ValidateRequest.check`; the
quality wing runs what passes. Option names in the messages are the command's (``--lengths``), since that is where
a user gives them; a Python caller gives the same fields."""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from kvcx.errors import KvcxError
from kvcx.quality import ranks, stats
from kvcx.quality.models import SPREAD

TASKS = ("perplexity", "passkey", "ruler")


@dataclass(frozen=True)
class ValidateRequest:
    """A validate run's task and the options that depend on it. ``tasks``, ``lengths`` and ``depths`` are the
    comma-separated texts the user gave (None: not given); ``pressed``: the labels of the settings with a press;
    ``tolerance``: a retired option, refused with what replaced it."""

    task: str = "perplexity"
    tasks: Optional[str] = None
    lengths: Optional[str] = None
    depths: Optional[str] = None
    query_aware: bool = False
    alpha: float = stats.ALPHA
    mode: str = "prefix"
    backend: Optional[str] = None
    quick_test: bool = False
    tolerance: Optional[int] = None
    pressed: Tuple[str, ...] = ()
    device: Optional[str] = None
    keys_before_rope: bool = False

    @property
    def retrieval(self) -> bool:
        """Whether the task asks retrieval prompts (ruler, passkey) rather than perplexity windows."""
        return self.task in ("passkey", "ruler")

    def check(self) -> None:
        """A KvcxError naming the first option that does not go with the task (or with another option), and how
        to fix it; nothing when the request can run."""
        if self.task not in TASKS:
            raise KvcxError(f"--task {self.task!r} must be perplexity, ruler or passkey")
        if not self.retrieval:
            for opt, given in (("--lengths", self.lengths), ("--depths", self.depths), ("--tasks", self.tasks),
                               ("--query-aware", self.query_aware or None)):
                if given is not None:
                    raise KvcxError(f"{opt} sets the retrieval tasks' prompts; add --task ruler (or --task passkey), "
                                    "or use --window for perplexity")
        if self.tasks is not None and self.task != "ruler":
            raise KvcxError("--tasks picks ruler's tasks; add --task ruler")
        if self.tolerance is not None:
            raise KvcxError("--tolerance was replaced by a paired test: a setting fails where it answers "
                            "significantly fewer prompts than the exact cache (McNemar's exact test, --alpha 0.05, "
                            "Holm over lengths and tasks); leave --tolerance out")
        if self.backend is not None and (self.retrieval or self.quick_test):
            raise KvcxError("--backend chooses where a model's cache is compressed for perplexity; --task passkey "
                            "and --quick-test do not take it: leave it out")
        if self.pressed and self.quick_test:
            raise KvcxError(f"--scheme {self.pressed[0]}: a press reads a model's cache (and SnapKV its queries); "
                            "--quick-test has no model: leave it out")
        if self.keys_before_rope and self.quick_test:
            raise KvcxError("--keys-before-rope turns keys with a model's own RoPE frequencies; --quick-test has no "
                            "model: leave it out")
        if self.device is not None and self.quick_test:
            raise KvcxError("--device places a model; --quick-test has none: leave it out")
        if self.device == SPREAD and self.mode != "prefix":
            raise KvcxError(f"--device auto spreads one model over the GPUs for prefix mode and --task ruler / "
                            f"passkey; --mode {self.mode} runs KvcxCache on one device: give --device cuda:0, or "
                            "--mode prefix")
        if ranks.launched() and self.quick_test:
            raise KvcxError("--quick-test runs in one process; the windows of --task perplexity and the prompts of "
                            "--task ruler / passkey are what torchrun / accelerate launch shard: run it without a "
                            "launcher")
        if self.retrieval:
            if self.mode != "prefix":
                raise KvcxError(f"--task {self.task} runs in prefix mode (the prompt's cache compressed once); not "
                                f"--mode {self.mode}")
            if not 0.0 < self.alpha < 1.0:
                raise KvcxError(f"--alpha {self.alpha} must be a significance level between 0 and 1 (e.g. 0.05)")
            self.retrieval_lengths()
            self.retrieval_depths()

    def retrieval_tasks(self) -> List[str]:
        """The retrieval tasks' names: passkey, or ruler's (all, or the ``tasks`` given)."""
        from kvcx.quality import ruler

        return ["passkey"] if self.task == "passkey" else ruler.task_names(self.tasks or "ruler")

    def retrieval_lengths(self) -> Optional[List[int]]:
        """The context lengths given (None: the default ladder)."""
        return _numbers("--lengths", self.lengths, int, "token counts, comma-separated (e.g. 1024,4096)")

    def retrieval_depths(self) -> Optional[List[float]]:
        """The needle depths given (None: the default depths)."""
        return _numbers("--depths", self.depths, float, "fractions of the context, comma-separated (e.g. 0.1,0.5,0.9)")


def _numbers(option: str, text: Optional[str], kind, example: str) -> Optional[Sequence]:
    if text is None:
        return None
    try:
        return [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise KvcxError(f"{option} {text!r} must be {example}") from None
