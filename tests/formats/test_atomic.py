"""Outputs written safely: signals mid-write, file modes, a failure between renames."""
import os
import signal
import stat
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import kvcx.formats.atomic as fileio
from kvcx.api import compress_kv_cache
from kvcx.errors import FormatError
from kvcx.formats import safetensors as kst


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_signal_mid_write_leaves_no_temp_and_the_old_output(tmp_path, sig):
    out = tmp_path / "out.safetensors"
    kst.save_file({"a": np.zeros(4, np.float32)}, out)
    before = out.read_bytes()
    code = textwrap.dedent(f"""
        import sys, time, numpy as np
        import kvcx.formats.atomic as fileio
        from kvcx.formats import safetensors as st
        real = fileio.write_bytes_to
        def slow(tmp, target, chunks):
            open(tmp, "wb").write(b"partial")
            print("WRITING", flush=True)
            time.sleep(30)
            real(tmp, target, chunks)
        fileio.write_bytes_to = slow
        st.write_bytes_to = slow
        st.save_file({{"b": np.ones(1 << 20, np.float32)}}, {str(out)!r})
    """)
    def default_signals():  # a runner under nohup or in the background ignores SIGHUP / SIGINT, and kvcx
        for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):  # rightly leaves ignored signals ignored
            signal.signal(s, signal.SIG_DFL)

    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         preexec_fn=default_signals)
    assert p.stdout.readline().strip() == "WRITING"
    assert list(tmp_path.glob(".kvcx-*.tmp"))  # mid-write: the temporary file exists
    p.send_signal(sig)
    p.wait(timeout=30)
    assert p.returncode in (-sig, 128 + sig, 1), (p.returncode, p.stderr.read())
    assert not list(tmp_path.glob(".kvcx-*")), list(tmp_path.iterdir())
    assert out.read_bytes() == before


def test_modes_follow_umask_and_existing_files(small_cache_file, tmp_path):
    old = os.umask(0o022)
    try:
        out = tmp_path / "new.safetensors"
        compress_kv_cache(small_cache_file, out)
        assert stat.S_IMODE(out.stat().st_mode) == 0o644
        assert stat.S_IMODE((tmp_path / "new.safetensors.metadata.json").stat().st_mode) == 0o644
        os.umask(0o027)
        out2 = tmp_path / "new2.safetensors"
        kst.save_file({"a": np.zeros(1, np.float32)}, out2)
        assert stat.S_IMODE(out2.stat().st_mode) == 0o640
        os.chmod(out, 0o664)
        compress_kv_cache(small_cache_file, out)  # replacing keeps the existing file's mode
        assert stat.S_IMODE(out.stat().st_mode) == 0o664
    finally:
        os.umask(old)


def test_failure_between_renames_rolls_back(small_cache_file, tmp_path, monkeypatch):
    good = tmp_path / "good.safetensors"
    compress_kv_cache(small_cache_file, good)
    before = good.read_bytes(), (tmp_path / "good.safetensors.metadata.json").read_bytes()
    real_replace = os.replace

    def failing_replace(src, dst):
        if str(dst).endswith(".metadata.json") and ".kvcx-" in str(src) and not str(src).endswith(".bak"):
            raise OSError(28, "No space left on device")
        return real_replace(src, dst)

    monkeypatch.setattr(fileio.os, "replace", failing_replace)
    with pytest.raises(FormatError, match="good.safetensors.metadata.json: cannot write .No space left"):
        compress_kv_cache(small_cache_file, good, scheme="reference")
    monkeypatch.undo()
    assert good.read_bytes() == before[0]  # the main output was renamed, then rolled back
    assert (tmp_path / "good.safetensors.metadata.json").read_bytes() == before[1]
    assert not list(tmp_path.glob(".kvcx-*"))
