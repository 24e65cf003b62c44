"""What every bench script writes under its table: the command, the machine and the date (imported by the
scripts from the ``bench`` package; they run as ``python -m bench.NAME`` from the repository root)."""
from __future__ import annotations

import datetime
import os
import platform
import shlex
import sys
from pathlib import Path


def machine() -> str:
    """CPU model, cores and the kvcx build's SIMD flags and threads, in one line."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    from kvcx.codecs.runtime import build_info

    b = build_info()
    return (f"{cpu}, {os.cpu_count()} cores; kvcx {' '.join(b['simd'])}, OpenMP "
            f"{'on' if b['openmp'] else 'off'}, {b['threads_used']} threads")


def _invocation() -> str:
    """How the running script was started: ``-m bench.NAME`` (run as a module, as the Makefile does), or its path."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name:
        return f"-m {spec.name}"
    return Path(sys.argv[0]).as_posix()


def header(what: str) -> str:
    """A results file's first lines: what was measured, the command that measured it, where and when."""
    cmd = "python " + " ".join([_invocation()] + [shlex.quote(a) for a in sys.argv[1:]])   # as a shell reads it
    day = datetime.date.today().isoformat()
    return f"<!-- written by `{cmd}`; do not edit by hand -->\n\n{what}\n\nCommand: `{cmd}`. Machine: {machine()}. " \
           f"Date: {day}.\n"


class Report:
    """Print lines as the bench goes and keep them; ``write(path)`` saves them under a header."""

    def __init__(self):
        self.lines = []

    def __call__(self, *parts, **kw) -> None:
        text = " ".join(str(p) for p in parts)
        print(text, flush=True, **{k: v for k, v in kw.items() if k != "flush"})
        self.lines.append(text)

    def write(self, path, what: str) -> None:
        """Save the lines under a header at ``path``, atomically (the old file stays whole if anything fails). A
        path that cannot be written ends the script with a message, not a traceback: the table was printed."""
        from kvcx.errors import KvcxError
        from kvcx.formats.atomic import OutputSet

        text = header(what) + "\n" + "\n".join(self.lines).strip() + "\n"
        try:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            with OutputSet([path]) as tmp:
                Path(tmp[os.fspath(path)]).write_text(text)
        except (OSError, KvcxError) as exc:
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise SystemExit(f"{Path(sys.argv[0]).name}: cannot write {path} ({why}); the table is printed above: "
                             "pass a writable --markdown path to save it") from None


def held_out_text(path: Path) -> Path:
    """A copy of the text from its first article heading (`` = Title = ``) after the middle, in a temporary file
    (removed at exit): the held-out windows."""
    import atexit
    import os
    import re
    import tempfile

    text = Path(path).read_text(encoding="utf-8")
    m = re.compile(r"^ = [^=].* = $", re.M).search(text, len(text) // 2)
    fd, name = tempfile.mkstemp(suffix=".raw", prefix="kvcx-held-out-")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text[m.start() if m else len(text) // 2:])
    atexit.register(os.unlink, name)
    return Path(name)
