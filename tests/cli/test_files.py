"""Every file a command touches (hardening, second round): no output is any input, only regular files,
inputs that change while read, leftovers of killed writers and races between writers, validate's inputs."""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from helpers import run, small_cache
from kvcx.errors import FormatError, KvcxError
from kvcx.formats import safetensors as kst

KVCX = [sys.executable, "-m", "kvcx"]


def _plan(tmp_path, name="p.json"):
    from kvcx.api import read_plan

    p = tmp_path / name
    p.write_text(json.dumps(read_plan("smollm2-kvcx2-3.50")))
    return p


# ---------------------------------------------------------------------------------------------
# 1. no output may be any input: plans, sidecars, reused measurements, the evaluation text, pictures
# ---------------------------------------------------------------------------------------------

def test_no_output_is_any_input(small_cache_file, tmp_path):
    plan = _plan(tmp_path)
    before = plan.read_bytes()
    cases = [
        (["compress", small_cache_file, plan, "--plan", plan], "output is the plan file"),
        (["compress", small_cache_file, tmp_path / "o.safetensors", "--plan", tmp_path / "o.safetensors.metadata.json"],
         "output is the plan file"),
        (["metrics", small_cache_file, "--plan", plan, "--plot", plan], "output is the plan file"),
        (["metrics", small_cache_file, "--plot", small_cache_file], "output is the input file"),
        (["metrics", small_cache_file, "--plot", f"{small_cache_file}.metadata.json"], "output is the input file's sidecar"),
        (["calibrate", "--reuse", plan, "--budget", "3.5", "--out", plan], "output is the reused plan file"),
        (["calibrate", "--scheme", "kvcx3", "--budget", "3.5", "--dataset-file", plan, "--out", plan],
         "output is the evaluation text file"),
    ]
    (tmp_path / "o.safetensors.metadata.json").write_bytes(before)   # a plan where a sidecar would go
    for args, message in cases:
        t = time.perf_counter()
        r = run(*args)
        assert r.exit_code == 1 and message in r.output and "Traceback" not in r.output, (args, r.output)
        assert time.perf_counter() - t < 10   # before any work (calibrate would load a model)
    assert plan.read_bytes() == before and (tmp_path / "o.safetensors.metadata.json").read_bytes() == before
    text = tmp_path / "t.raw"
    text.write_text("hello " * 1000)
    r = run("calibrate", "--scheme", "kvcx3", "--budget", "3.5", "--dataset-file", text, "--out", text)
    assert r.exit_code == 1 and "output is the evaluation text file" in r.output
    assert text.read_text() == "hello " * 1000


# ---------------------------------------------------------------------------------------------
# 3. only regular files: a FIFO never blocks a command, a device or FIFO is never replaced
# ---------------------------------------------------------------------------------------------

def _cli(args, timeout=60):
    p = subprocess.run(KVCX + [str(a) for a in args], capture_output=True, text=True, timeout=timeout)
    return p.returncode, p.stderr


def test_only_regular_files_are_read_or_replaced(small_cache_file, tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    out = tmp_path / "o.safetensors"
    for args in (["compress", fifo, out], ["decompress", fifo, out], ["metrics", fifo],
                 ["compress", small_cache_file, out, "--plan", fifo],
                 ["validate", "--dataset-file", fifo, "--max-windows", "1"],
                 ["calibrate", "--reuse", fifo, "--budget", "3", "--out", tmp_path / "x.json"]):
        code, err = _cli(args)   # a blocked open would time out here
        assert code == 1 and "a FIFO (named pipe), not a regular file" in err and "Traceback" not in err, (args, err)
    # a FIFO where the input's sidecar goes is refused too (compress reads the sidecar)
    plain = tmp_path / "c.safetensors"
    kst.save_file(small_cache(), plain)
    os.mkfifo(tmp_path / "c.safetensors.metadata.json")
    code, err = _cli(["compress", plain, out])
    assert code == 1 and "a FIFO" in err, err
    # outputs: a FIFO or a device in an output's place is an error, and stays what it was
    for target in (fifo, "/dev/null"):
        code, err = _cli(["compress", small_cache_file, target])
        assert code == 1 and "not a regular file" in err and "writes its outputs to regular files only" in err, err
    assert os.path.exists("/dev/null") and not os.path.isfile("/dev/null")
    import stat

    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    from kvcx.formats.jsonio import read_json_object
    from kvcx.quality.models import load_dataset_text

    for fn in (lambda: read_json_object(str(fifo), "the plan", "x"), lambda: load_dataset_text(fifo),
               lambda: kst.SafeFile(fifo)):
        with pytest.raises(FormatError, match="FIFO"):
            fn()


# ---------------------------------------------------------------------------------------------
# 4. an input that changes while it is read: an error with a message, never a signal
# ---------------------------------------------------------------------------------------------

def test_an_input_truncated_while_read_is_an_error(tmp_path, monkeypatch):
    src = tmp_path / "big.safetensors"
    kst.save_file({f"layer_{i}_key": np.ones((1, 4, 4096, 64), np.float16) for i in range(4)}, src)
    import kvcx.formats.safetensors as sf

    real = os.preadv
    calls = []

    def truncating(fd, buffers, offset):
        if not calls:   # another process truncates the file after the header was read
            os.truncate(src, 4096)
        calls.append(offset)
        return real(fd, buffers, offset)

    monkeypatch.setattr(sf.os, "preadv", truncating)
    from kvcx.api import compress_kv_cache

    with pytest.raises(FormatError, match="changed while kvcx read it|ended while kvcx read"):
        compress_kv_cache(src, tmp_path / "o.safetensors")
    assert not (tmp_path / "o.safetensors").exists()


def _opened(pid: int, path, timeout: float = 120.0) -> bool:
    """Wait until process ``pid`` holds ``path`` open (Linux's /proc); False if it exits or /proc cannot tell."""
    fds, end = f"/proc/{pid}/fd", time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            if any(os.readlink(os.path.join(fds, fd)) == str(path) for fd in os.listdir(fds)):
                return True
        except FileNotFoundError:   # an fd closed while listed, or the process is gone
            if not os.path.exists(fds):
                return False
        except OSError:
            return False
        time.sleep(0.001)
    return False


def test_a_real_truncation_race_never_kills_kvcx_with_a_signal(tmp_path):
    """A 128 MiB cache truncated by another process while `kvcx compress` reads it (a reader that maps the
    file is killed with SIGBUS by a truncation under the mapping). The truncation comes at once (before kvcx has
    started, let alone opened the file), then at delays after kvcx opened it, whatever the machine's speed (fixed
    delays from the start landed before the open on a slow machine, where the interpreter's imports alone take
    longer)."""
    src = tmp_path / "big.safetensors"
    kst.save_file({f"layer_{i}_value": np.ones((1, 8, 32768, 64), np.float16) for i in range(4)}, src)
    data = src.read_bytes()
    seen = set()
    for delay in (None, 0.0, 0.01, 0.05):
        src.write_bytes(data)
        p = subprocess.Popen(KVCX + ["compress", str(src), str(tmp_path / "o.safetensors")], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
        if delay is not None and _opened(p.pid, src):
            time.sleep(delay)
        os.truncate(src, 1 << 20)
        _, err = p.communicate(timeout=120)
        assert p.returncode in (0, 1), (p.returncode, err)   # never -SIGBUS
        if p.returncode == 1:   # truncated before kvcx opened it, or while it read it
            assert ("while kvcx read" in err or "the file is truncated" in err) and "Traceback" not in err, err
            seen.add("while" if "while kvcx read" in err else "before")
    assert "while" in seen, seen   # the truncation landed during a read at least once


# ---------------------------------------------------------------------------------------------
# 5. leftovers of killed writers, and two writers of one output
# ---------------------------------------------------------------------------------------------

def _dead_pid():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_stale_temporary_files_of_dead_writers_are_cleared(small_cache_file, tmp_path):
    out = tmp_path / "o.safetensors"
    dead, live = _dead_pid(), subprocess.Popen(["sleep", "60"])
    try:
        stale = [tmp_path / f".kvcx-o.safetensors.{dead}.0123456789ab.tmp",
                 tmp_path / f".kvcx-o.safetensors.metadata.json.{dead}.0123456789ab.tmp"]
        kept = [tmp_path / f".kvcx-o.safetensors.{live.pid}.0123456789ab.tmp",   # a live writer's
                tmp_path / f".kvcx-other.safetensors.{dead}.0123456789ab.tmp"]   # another target's
        for f in stale + kept:
            f.write_bytes(b"partial")
        r = run("compress", small_cache_file, out)
        assert r.exit_code == 0, r.output
        assert not any(f.exists() for f in stale) and all(f.exists() for f in kept)
    finally:
        live.kill()
        live.wait()


def test_sigkill_mid_write_then_the_next_run_cleans_up(small_cache_file, tmp_path):
    out = tmp_path / "o.safetensors"
    code = textwrap.dedent(f"""
        import sys, time
        import kvcx.formats.atomic as atomic
        import kvcx.formats.safetensors as st
        real = atomic.write_bytes_to
        def slow(tmp, target, chunks):
            open(tmp, "wb").write(b"partial")
            print("WRITING", flush=True)
            time.sleep(60)
        atomic.write_bytes_to = slow
        st.write_bytes_to = slow
        from kvcx.api import compress_kv_cache
        compress_kv_cache({str(small_cache_file)!r}, {str(out)!r})
    """)
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "WRITING"
    p.send_signal(signal.SIGKILL)
    p.wait()
    left = list(tmp_path.glob(".kvcx-*.tmp"))
    assert left and not out.exists()   # SIGKILL cannot be cleaned up after
    r = run("compress", small_cache_file, out)
    assert r.exit_code == 0 and out.exists()
    assert not list(tmp_path.glob(".kvcx-*")), list(tmp_path.iterdir())


def test_two_writers_of_one_output_leave_a_matched_pair(tmp_path):
    """Two processes compressing different inputs (one with a sidecar, one without) to one output at once:
    after every round the packed file and the sidecar beside it come from the same writer."""
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    kst.save_file(small_cache(), a)
    (tmp_path / "a.safetensors.metadata.json").write_text(json.dumps({"model_name": "A"}))
    kst.save_file({k: v * 2 if v.dtype != np.int64 else v for k, v in small_cache().items()}, b)
    out = tmp_path / "o.safetensors"
    script = ("import sys\nfrom kvcx.api import compress_kv_cache\n"
              "for _ in range(int(sys.argv[3])):\n    compress_kv_cache(sys.argv[1], sys.argv[2])\n")
    for _ in range(6):
        ps = [subprocess.Popen([sys.executable, "-c", script, str(src), str(out), "3"]) for src in (a, b)]
        assert [p.wait(timeout=120) for p in ps] == [0, 0]
        meta = kst.read_metadata(out)
        side = tmp_path / "o.safetensors.metadata.json"
        if "kvcx.sidecar" in meta:
            assert side.exists() and json.loads(side.read_text()) == json.loads(meta["kvcx.sidecar"])
        else:
            assert not side.exists()
    assert not list(tmp_path.glob(".kvcx-*"))


# ---------------------------------------------------------------------------------------------
# 9. validate's inputs: a model directory's config, --window 0
# ---------------------------------------------------------------------------------------------

def test_validate_refuses_a_bad_model_config_and_window_0(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    text = tmp_path / "t.raw"
    text.write_text("hello world " * 200)
    for config in ("[1, 2]", "{", '"text"'):
        (model / "config.json").write_text(config)
        r = run("validate", "--model", model, "--dataset-file", text, "--max-windows", "1")
        assert r.exit_code == 1 and "config.json" in r.output and "Traceback" not in r.output, r.output
    for window in ("0", "1"):
        r = run("validate", "--window", window, "--dataset-file", text)
        assert r.exit_code == 1 and f"--window {window} and --stride 512 must be at least 2" in r.output, r.output
    with pytest.raises(KvcxError, match="window=0"):
        from kvcx.quality.validation import run_validation
        from kvcx.codecs import KVConfig

        run_validation(KVConfig.from_scheme(), window=0, dataset_file=text)
