"""The gate data-parallel: under ``torchrun`` or ``accelerate launch`` each process (a rank) scores every
``world``-th window (or retrieval prompt), and rank 0 gathers the windows' scores and adds them in the windows'
order, so an N-rank run gives the 1-rank run's sums (perplexities, deltas, KLD, top-1, error statistics) to the last
digit on the CPU; retrieval prompts' answers are put back in the prompts' order (the same counts and p-values).

    torchrun --nproc-per-node 2 -m kvcx validate --max-windows 16      # 2 processes, gloo on the CPU
    accelerate launch --multi_gpu --num_processes 2 -m kvcx validate ...   # the same ranks (on the CPU too)

The launchers set ``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``; with
``WORLD_SIZE`` above 1 :func:`join` starts torch.distributed (gloo on the CPU, NCCL on CUDA: each rank on the GPU
its ``LOCAL_RANK`` names). Rank 0 alone prints, writes and exits with the verdict; the others return nothing.
A single process (no launcher) runs as before: no process group is started and every window is its own.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from typing import Dict, List, Mapping, Sequence

from kvcx.errors import KvcxError


@dataclass(frozen=True)
class Rank:
    """This process's place in the run: ``index`` of ``size`` ranks (0 of 1 alone)."""

    index: int = 0
    size: int = 1

    @property
    def leads(self) -> bool:
        """Whether this rank prints, writes and gives the verdict (rank 0)."""
        return self.index == 0

    def shard(self, items: Sequence) -> list:
        """The items this rank works: every ``size``-th from its index (the windows' order kept)."""
        return list(items[self.index::self.size])

    def check_enough(self, count: int, what: str, fix: str) -> None:
        """KvcxError when there are fewer ``what`` (windows, prompts) than ranks: every rank needs one; ``fix``
        says which option gives more."""
        if self.size > count:
            raise KvcxError(f"{self.size} ranks and {count} {what}s: every rank needs a {what}; {fix}, or start "
                            "fewer processes")


ALONE = Rank()


def launched() -> bool:
    """Whether a launcher started this process as one of several (``WORLD_SIZE`` above 1)."""
    return _env_int("WORLD_SIZE", 1) > 1


def follows() -> bool:
    """Whether this process is a launched rank other than 0 (which reports nothing: rank 0 does)."""
    return launched() and _env_int("RANK", 0) != 0


def join(device_type: str) -> Rank:
    """This process's rank, torch.distributed started for it where a launcher asks for several (gloo on the CPU,
    NCCL on CUDA); :data:`ALONE` otherwise."""
    if not launched():
        return ALONE
    import torch.distributed as dist

    size, index = _env_int("WORLD_SIZE", 1), _env_int("RANK", 0)
    if not dist.is_available():
        raise KvcxError(f"WORLD_SIZE={size}: this torch has no torch.distributed; run one process, or install a "
                        "torch built with it")
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo")
    if dist.get_world_size() != size or dist.get_rank() != index:
        raise KvcxError(f"torch.distributed says rank {dist.get_rank()} of {dist.get_world_size()}, the launcher "
                        f"RANK={index} of WORLD_SIZE={size}: start every rank with the same launcher")
    return Rank(index, size)


def planned() -> Rank:
    """The rank a launcher started this process as, read from its environment before torch.distributed is joined:
    for the checks that refuse a request before a model loads (:data:`ALONE` without a launcher)."""
    return Rank(_env_int("RANK", 0), _env_int("WORLD_SIZE", 1)) if launched() else ALONE


def local_device(device, cpu: bool):
    """The device a rank's model goes to: as asked, else the GPU ``LOCAL_RANK`` names when CUDA is there.
    ``"auto"`` (one model spread over the machine's GPUs) is refused under a launcher: every rank would take them all."""
    from kvcx.quality.models import SPREAD

    if device == SPREAD and launched() and not cpu:
        raise KvcxError("--device auto spreads one model over this machine's GPUs, and every rank of a launcher would "
                        "take them all: start one process, or let each rank take the GPU its LOCAL_RANK names "
                        "(leave --device out)")
    if device is not None or cpu or not launched():
        return device
    import torch

    if not torch.cuda.is_available():
        return device
    return f"cuda:{_env_int('LOCAL_RANK', 0) % torch.cuda.device_count()}"


def same_request(rank: Rank, request: Mapping) -> None:
    """Every rank must run the same request (options, text, model): a KvcxError naming the first that differs
    from rank 0 (each rank parsed its own command line; a launcher gives them the same one)."""
    if rank.size == 1:
        return
    import torch.distributed as dist

    # a setting by its config where it has one (KVConfig, codecs), else its repr; only the digest travels
    digest = hashlib.sha256(json.dumps(request, sort_keys=True, default=lambda o: o.get_config() if hasattr(
        o, "get_config") else repr(o)).encode()).hexdigest()
    every: List[str] = [""] * rank.size
    dist.all_gather_object(every, digest)
    odd = [i for i, d in enumerate(every) if d != every[0]]
    if odd:
        raise KvcxError(f"rank {odd[0]} of {rank.size} was started with other options, text or model than rank 0: "
                        "start every rank with the same command")


def gather_runs(rank: Rank, runs: Dict[str, "PerplexityRun"], windows: int) -> Dict[str, "PerplexityRun"]:  # noqa: F821
    """Rank 0: every rank's windows of each setting, added in the windows' order (window ``i`` was scored by rank
    ``i % size``, its ``i // size``-th); the other ranks: their own runs (not a result: :meth:`Rank.leads`)."""
    if rank.size == 1:
        return runs
    parts = gather(rank, {label: run.records for label, run in runs.items()})
    return merge(parts, windows) if rank.leads else runs


def gather(rank: Rank, part):
    """Rank 0: every rank's ``part`` (picklable), ranks in order; the other ranks: None (one process: [part])."""
    if rank.size == 1:
        return [part]
    import torch.distributed as dist

    parts = [None] * rank.size if rank.leads else None
    dist.gather_object(part, parts, dst=0)
    return parts


def broadcast(rank: Rank, obj):
    """Rank 0's ``obj`` (picklable) on every rank (one process: ``obj``)."""
    if rank.size == 1:
        return obj
    import torch.distributed as dist

    box = [obj if rank.leads else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather_in_order(rank: Rank, mine: Sequence, total: int):
    """Rank 0: the ``total`` items every rank worked (its :meth:`Rank.shard`), back in their order (item ``i`` is
    rank ``i % size``'s ``i // size``-th); the other ranks: None (one process: ``mine`` as a list)."""
    parts = gather(rank, list(mine))
    return in_order(parts, total, "items") if rank.leads else None


def in_order(parts: Sequence[Sequence], total: int, what: str) -> list:
    """The ``total`` items of every rank's part (ranks in order) in the run's order: item ``i`` is rank
    ``i % len(parts)``'s ``i // len(parts)``-th; a KvcxError where the ranks worked another count."""
    got = [len(p) for p in parts]
    if sum(got) != total:
        raise KvcxError(f"{what}: the ranks worked {got}, {sum(got)} in all, not the run's {total}: a rank stopped "
                        "early; run again")
    return [parts[i % len(parts)][i // len(parts)] for i in range(total)]


def merge(parts: Sequence[Mapping[str, list]], windows: int) -> Dict[str, "PerplexityRun"]:  # noqa: F821
    """Each rank's window records (label -> records, ranks in order) as one run a setting, the windows added in
    their order: window ``i`` is rank ``i % len(parts)``'s ``i // len(parts)``-th."""
    from kvcx.quality.scoring import PerplexityRun

    merged = {}
    for label in parts[0]:
        run = PerplexityRun()
        for record in in_order([p[label] for p in parts], windows, f"setting {label!r}'s windows"):
            run.add_window(**record)
        merged[label] = run
    return merged


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise KvcxError(f"{name}={raw!r} is not a whole number: the launcher sets it (torchrun, accelerate "
                        "launch); unset it to run one process") from None
