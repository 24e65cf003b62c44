"""bench.report: what every bench script writes its table with. A results path that cannot be written ends the
script with a message naming it (the table was printed as the bench went), not a traceback; a written file replaces
the old one whole, with the mode a plain open() gives."""
import os

import pytest

from bench.report import Report


def _report():
    r = Report()
    r("| a | b |")
    return r


def test_the_table_is_written_under_its_header(tmp_path, capsys):
    out = tmp_path / "deeper" / "t.md"
    _report().write(out, "What was measured.")
    text = out.read_text()
    assert text.startswith("<!-- written by `python ") and "What was measured." in text and text.endswith("| a | b |\n")
    umask = os.umask(0)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o666 & ~umask
    assert [p.name for p in out.parent.iterdir()] == ["t.md"]   # no temporary file left
    assert "| a | b |" in capsys.readouterr().out               # printed as it went


@pytest.mark.parametrize("bad", ["a directory", "a missing parent under a file"])
def test_an_unwritable_path_ends_with_a_message(tmp_path, bad):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    path = tmp_path if bad == "a directory" else blocker / "t.md"
    with pytest.raises(SystemExit) as exc:
        _report().write(path, "What was measured.")
    msg = str(exc.value)
    assert f"cannot write {path}" in msg and "writable --markdown path" in msg
    assert blocker.read_text() == "x"
