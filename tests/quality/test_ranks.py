"""The gate data-parallel (kvcx.quality.ranks): windows sharded over ranks, rank 0 adding them in order, so that an
N-rank run's JSON is the one-process run's; started by the real torchrun, with gloo on the CPU."""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from kvcx.codecs.metrics import ErrorStats  # noqa: E402
from kvcx.errors import KvcxError  # noqa: E402
from kvcx.quality import ranks  # noqa: E402
from kvcx.quality.scoring import PerplexityRun  # noqa: E402

TIMING = ("wall_time_s", "codec_time_s")   # what differs between any two runs, one process or several
LOADING = "Loading weights"   # what transformers writes to stderr as a model loads


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _window_runs(windows: int, rank: ranks.Rank, seed: int = 0) -> dict:
    """Scores of ``windows`` windows (irregular floats, so that the order of the sums shows), as ``rank`` adds its
    share of them."""
    import random

    rnd = random.Random(seed)
    rows = [dict(base_nll=rnd.uniform(100, 900) / 3, comp_nll=rnd.uniform(100, 900) / 7, tokens=rnd.randint(9, 99),
                 original_bytes=1000, packed_bytes=rnd.randint(200, 300), values=500, codec_time_s=0.1,
                 stats=ErrorStats(n=7, sum_xx=rnd.random() / 3, sum_ee=rnd.random() / 11, sum_yy=rnd.random(),
                                  sum_xy=rnd.random() / 13, max_error=rnd.random()),
                 divergence=(rnd.random() / 17, rnd.randint(0, 9))) for _ in range(windows)]
    run = PerplexityRun()
    for row in rank.shard(rows):
        run.add_window(**row)
    return {"kvcx": run}


@pytest.mark.parametrize("size", [2, 3, 4])
def test_ranks_windows_added_in_order_give_the_one_process_sums(size):
    alone = _window_runs(11, ranks.ALONE)["kvcx"]
    parts = [{label: run.records for label, run in _window_runs(11, ranks.Rank(i, size)).items()}
             for i in range(size)]
    merged = ranks.merge(parts, 11)["kvcx"]
    for name in ("baseline_nll", "compressed_nll", "tokens", "windows", "packed_bytes", "kl_sum", "top1_matches"):
        assert getattr(merged, name) == getattr(alone, name), name        # bit for bit: the same order of sums
    assert merged.stats == alone.stats
    with pytest.raises(KvcxError, match="a rank stopped early"):
        ranks.merge(parts[:-1], 11)


def test_every_rank_needs_an_item_and_the_refusal_names_the_option():
    """Rank.check_enough, what validate (windows), retrieval (prompts) and calibrate (windows) call before any rank
    works: as many items as ranks is enough; fewer is one KvcxError naming the counts and the option to raise."""
    for rank in (ranks.ALONE, ranks.Rank(1, 3)):
        rank.check_enough(rank.size, "window", "give more")
    with pytest.raises(KvcxError, match=r"^3 ranks and 2 prompts: every rank needs a prompt; give more --prompts, "
                                        r"or start fewer processes$"):
        ranks.Rank(2, 3).check_enough(2, "prompt", "give more --prompts")


def test_a_launchers_environment_that_is_not_a_number_is_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(KvcxError, match="WORLD_SIZE='two' is not a whole number"):
        ranks.launched()
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert not ranks.launched() and ranks.join("cpu") is ranks.ALONE and not ranks.follows()


def _requests(index: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(index))
    rank = ranks.join("cpu")
    try:
        ranks.same_request(rank, {"window": 1024, "max_windows": 16 if index == 0 else 8})
        Path(out, str(index)).write_text("ran")
    except KvcxError as exc:
        Path(out, str(index)).write_text(str(exc))
    finally:
        torch.distributed.destroy_process_group()


def test_ranks_started_with_other_options_are_refused_by_name(tmp_path):
    torch.multiprocessing.spawn(_requests, args=(_free_port(), str(tmp_path)), nprocs=2)
    for i in range(2):
        said = (tmp_path / str(i)).read_text()
        assert "rank 1 of 2 was started with other options" in said, said


def _validate(wikitext, *args, launcher=(), env=None):
    cmd = [*launcher, "-m", "kvcx", "validate", "--dataset-file", str(wikitext), "--window", "256", "--stride",
           "128", "--json", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


def test_torchrun_and_accelerate_with_two_ranks_give_the_one_process_json(wikitext_path):
    """``torchrun --nproc-per-node 2 -m kvcx validate`` and ``accelerate launch --multi_gpu --num_processes 2``:
    each rank scores two of the four windows; rank 0 alone prints, and its JSON is the one-process run's, every
    figure to the last digit but the times; more ranks than windows is refused."""
    settings = ("--max-windows", "4", "--scheme", "kvcx,kvcx3")
    one = _validate(wikitext_path, *settings, launcher=[sys.executable])
    assert one.returncode == 0, one.stderr[-2000:]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                str(_free_port())]
    two = _validate(wikitext_path, *settings, launcher=torchrun)
    assert two.returncode == 0, two.stderr[-2000:]
    a, b = json.loads(one.stdout), json.loads(two.stdout)      # one JSON document: rank 1 printed nothing
    assert "windows 4/4" in one.stderr and "windows 2/2" in two.stderr and "windows 4/4" not in two.stderr
    assert [r["setting"] for r in b] == ["kvcx", "kvcx3"] and b[0]["windows"] == 4
    for x, y in zip(a, b):
        assert {k: v for k, v in x.items() if k not in TIMING} == {k: v for k, v in y.items() if k not in TIMING}

    # accelerate launch starts the same ranks (its multi-process launcher is torch's: on the CPU, gloo)
    accelerate = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                  "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port",
                  str(_free_port())]
    acc = _validate(wikitext_path, *settings, launcher=accelerate)
    assert acc.returncode == 0, acc.stderr[-2000:]
    c = json.loads(acc.stdout)
    assert [{k: v for k, v in x.items() if k not in TIMING} for x in c] == \
        [{k: v for k, v in x.items() if k not in TIMING} for x in a]
    assert "windows 2/2" in acc.stderr and "windows 4/4" not in acc.stderr   # two ranks ran: rank 0 scored 2

    few = _validate(wikitext_path, "--max-windows", "1", launcher=torchrun[:-1] + [str(_free_port())])
    assert few.returncode != 0 and "2 ranks and 1 windows: every rank needs a window" in few.stderr
    assert LOADING in one.stderr and LOADING not in few.stderr      # refused before the model loads


def test_torchrun_shards_retrieval_prompts_and_gives_the_one_process_json(wikitext_path):
    """``--task passkey`` under ``torchrun --nproc-per-node 2``: rank r answers prompts r, r + 2, ...; rank 0 puts
    every answer back in the prompts' order, so its JSON (cells, counts, p-values, bits) is the one-process run's
    but the times; more ranks than prompts is refused."""
    args = ("-m", "kvcx", "validate", "--task", "passkey", "--lengths", "512", "--depths", "0.3,0.9", "--prompts",
            "3", "--scheme", "kvcx,kvcx2", "--dataset-file", str(wikitext_path), "--json")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    one = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=600, env=env)
    assert one.returncode in (0, 1), one.stderr[-2000:]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                str(_free_port())]
    two = subprocess.run([*torchrun, *args], capture_output=True, text=True, timeout=600, env=env)
    assert two.returncode == one.returncode, two.stderr[-2000:]
    a, b = json.loads(one.stdout), json.loads(two.stdout)      # one JSON document: rank 1 printed nothing
    assert "prompts 6/6" in one.stderr and "prompts 3/3" in two.stderr and "prompts 6/6" not in two.stderr
    timing = TIMING + ("seconds",)
    assert [{k: v for k, v in x.items() if k not in timing} for x in a] == \
        [{k: v for k, v in x.items() if k not in timing} for x in b]
    assert sum(c["prompts"] for c in b[0]["cells"]) == 6
    alone = [*args[:8], "0.5", "--prompts", "1", *args[11:]]   # one prompt for two ranks
    few = subprocess.run([*torchrun[:-1], str(_free_port()), *alone], capture_output=True, text=True, timeout=600,
                         env=env)
    assert few.returncode != 0 and "2 ranks and 1 prompts: every rank needs a prompt" in few.stderr
    assert LOADING in one.stderr and LOADING not in few.stderr      # refused before the model loads


@pytest.fixture(scope="module")
def tiny_model_dir(loaded, tmp_path_factory):
    """A 2-layer Llama of seeded random weights with the embedded model's tokenizer, saved as a local model
    directory: calibration's code paths (every layer x option x window) in seconds, not quality."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = loaded[1]
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=256,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         head_dim=32, max_position_embeddings=2048))
    path = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _calibrate(tmp_path, name: str, launcher: list, *args) -> tuple:
    """``kvcx calibrate ... --json --out tmp/name`` under ``launcher``: (process, the plan file's JSON or None)."""
    out = tmp_path / name
    r = subprocess.run([*launcher, "-m", "kvcx", "calibrate", *args, "--out", str(out), "--json"], capture_output=True,
                       text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return r, (json.loads(out.read_text()) if out.exists() else None)


@pytest.mark.parametrize("args", [("--scheme", "kvcx3", "--budget", "3.2", "--windows", "3"),
                                  ("--scheme", "kvcx2w", "--budget", "2.5", "--options", "b2w,b3w", "--windows",
                                   "3")],
                         ids=["per-layer-widths", "query-weights"])
def test_torchrun_shards_calibration_windows_and_writes_the_one_process_plan(wikitext_path, tiny_model_dir, tmp_path,
                                                                            args):
    """``kvcx calibrate`` under ``torchrun --nproc-per-node 2`` (a tiny random model: the code paths): rank r measures
    windows r, r + 2, ... (each layer's KLD per option; for kvcx2w the queries' weights), 2 and 1 windows; rank 0
    adds them in the windows' order, allocates and alone prints and writes: the plan file and the JSON are the
    one-process run's but the time. More ranks than windows
    is refused; --guard-retrieval (prompts, not windows) says it runs in one process."""
    data = ("--model", str(tiny_model_dir), "--dataset-file", str(wikitext_path), "--offset", "0")
    one, plan1 = _calibrate(tmp_path, "one.json", [sys.executable], *args, *data)
    assert one.returncode == 0, one.stderr[-2000:]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                str(_free_port())]
    two, plan2 = _calibrate(tmp_path, "two.json", torchrun, *args, *data)
    assert two.returncode == 0, two.stderr[-2000:]
    a, b = json.loads(one.stdout), json.loads(two.stdout)   # one JSON document: rank 1 printed nothing
    for x in (a, b, plan1, plan2):
        x.pop("wall_time_s")
    assert a == b and plan1 == plan2 == a
    assert a["config"] and (a["sensitivity"] or a["config"].get("key_weights"))
    if args[1] == "kvcx2w":
        return
    few, _ = _calibrate(tmp_path, "few.json", torchrun[:-1] + [str(_free_port())], *args[:-1], "1", *data)
    assert few.returncode != 0 and "2 ranks and 1 windows: every rank needs a window" in few.stderr
    assert LOADING in one.stderr and LOADING not in few.stderr      # refused before the model loads
    assert not (tmp_path / "few.json").exists()


def test_guard_retrieval_under_a_launcher_is_refused(monkeypatch):
    """--guard-retrieval answers passkey prompts in one process: started by a launcher it says so before any work,
    rather than answer every prompt on every rank."""
    from kvcx.codecs import KVConfig
    from kvcx.quality.guard import GUARD_DEPTHS, check_guard

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(KvcxError, match="--guard-retrieval runs in one process"):
        check_guard(KVConfig.from_scheme("kvcx"), 8192, 8, GUARD_DEPTHS, 0.5)
