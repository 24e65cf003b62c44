"""Writing outputs safely: every file of one command committed together or not at all.

>>> with OutputSet(["out.safetensors", "out.safetensors.metadata.json"]) as tmp:
...     write(tmp["out.safetensors"]); write(tmp["out.safetensors.metadata.json"])

- Temporary files are created beside their targets with ``O_CREAT | O_EXCL`` and mode
  0666, so the umask applies exactly as for a plain ``open(path, "w")``; a target that
  already exists keeps its mode.
- On success the targets are replaced together: each existing target is kept as a hard
  link (or renamed) backup until every rename has succeeded; if one fails, the ones done
  are rolled back and the error names the target. ``remove=`` targets (a stale sidecar)
  are removed in the same transaction.
- On any failure, and on SIGINT, SIGTERM or SIGHUP (when no handler of the program's own
  is installed), the temporary files are removed and the old outputs stay as they were;
  a signal is then delivered again with its default action, so the process still ends
  as the signal asks.
"""
from __future__ import annotations

import os
import secrets
import signal
import stat
import threading
from contextlib import contextmanager
from typing import Dict, Iterable, Iterator, List, Optional, Sequence

from kvcx.errors import FormatError, KvcxError

TMP_PREFIX = ".kvcx-"
TMP_SUFFIX = ".tmp"
CAUGHT_SIGNALS = tuple(s for s in (getattr(signal, "SIGTERM", None), getattr(signal, "SIGHUP", None)) if s)


class SignalExit(BaseException):
    """Raised in the main thread when SIGTERM/SIGHUP arrives while outputs are being written."""

    def __init__(self, signum: int):
        super().__init__(f"signal {signum}")
        self.signum = signum


def _raise_signal(signum, _frame):
    raise SignalExit(signum)


@contextmanager
def signals_as_exceptions() -> Iterator[None]:
    """While inside: SIGTERM/SIGHUP raise :class:`SignalExit` (main thread, default handlers only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {}
    for s in CAUGHT_SIGNALS:
        if signal.getsignal(s) == signal.SIG_DFL:
            previous[s] = signal.signal(s, _raise_signal)
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def redeliver(exc: SignalExit) -> None:
    """End the process as the signal would have (default action), after cleaning up."""
    signal.signal(exc.signum, signal.SIG_DFL)
    os.kill(os.getpid(), exc.signum)
    raise SystemExit(128 + exc.signum)  # only reached if the signal is blocked in this thread


def _why(exc: OSError) -> str:
    return exc.strerror or str(exc)


def same_path(a, b) -> bool:
    """Whether two paths name the same file: by inode when both exist, else by resolved path."""
    a, b = os.fspath(a), os.fspath(b)
    try:
        if os.path.exists(a) and os.path.exists(b):
            return os.path.samefile(a, b)
    except OSError:
        pass
    return os.path.realpath(a) == os.path.realpath(b)


def check_distinct(inputs: Iterable, outputs: Iterable) -> None:
    """KvcxError if any output (or two outputs) is the same file as an input, through any spelling or link."""
    inputs = [os.fspath(p) for p in inputs]
    outputs = [os.fspath(p) for p in outputs]

    def k_is_main(i, ins):
        return i == ins[0]

    for o in outputs:
        for i in inputs:
            if same_path(o, i):
                what = "the input file" if k_is_main(i, inputs) else "an input file"
                raise KvcxError(f"{o}: output is {what} ({i}); choose another output path")
    for k, o in enumerate(outputs):
        for o2 in outputs[k + 1:]:
            if same_path(o, o2):
                raise KvcxError(f"{o}: two outputs of this command are the same file ({o2}); choose another path")


def check_output_path(path) -> None:
    """FormatError unless ``path`` can be an output file: its directory exists, it is not a directory."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise FormatError(f"{path}: the output directory {directory} does not exist; create it first")
    if os.path.isdir(path):
        raise FormatError(f"{path}: is a directory; give an output file name")


def _create_tmp(target: str) -> str:
    directory = os.path.dirname(os.path.abspath(target))
    for _ in range(100):
        tmp = os.path.join(directory, f"{TMP_PREFIX}{secrets.token_hex(6)}{TMP_SUFFIX}")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask applies, as for open()
        except FileExistsError:
            continue
        except OSError as exc:
            raise FormatError(f"{target}: cannot write in {directory} ({_why(exc)}); check the directory's "
                              "permissions and free space") from None
        try:
            st = os.stat(target)
            if stat.S_ISREG(st.st_mode):
                os.fchmod(fd, stat.S_IMODE(st.st_mode))  # replacing a file keeps its mode
        except FileNotFoundError:
            pass
        except OSError as exc:
            os.close(fd)
            os.unlink(tmp)
            raise FormatError(f"{target}: cannot read its current mode ({_why(exc)})") from None
        os.close(fd)
        return tmp
    raise FormatError(f"{target}: cannot create a temporary file in {directory}")


def _backup(target: str) -> Optional[str]:
    """Keep an existing target's content under a backup name (a hard link where possible)."""
    if not os.path.lexists(target):
        return None
    directory = os.path.dirname(os.path.abspath(target))
    bak = os.path.join(directory, f"{TMP_PREFIX}{secrets.token_hex(6)}.bak")
    try:
        os.link(target, bak, follow_symlinks=False)
    except OSError:
        os.replace(target, bak)  # no hard links here: rename; the target is absent until its new file lands
    return bak


class OutputSet:
    """The output files of one command: written to temporary files, then committed together."""

    def __init__(self, targets: Sequence, remove: Sequence = ()):
        self.targets: List[str] = [os.fspath(t) for t in targets]
        self.remove: List[str] = [os.fspath(t) for t in remove if os.path.lexists(os.fspath(t))]
        self.tmp: Dict[str, str] = {}
        self._signals = None

    def check(self) -> "OutputSet":
        """Fail early (before any compute) if a target cannot be written."""
        for t in self.targets:
            check_output_path(t)
        return self

    def __enter__(self) -> Dict[str, str]:
        self.check()
        self._signals = signals_as_exceptions()
        self._signals.__enter__()
        try:
            for t in self.targets:
                self.tmp[t] = _create_tmp(t)
        except BaseException as exc:
            self._cleanup()
            self._signals.__exit__(None, None, None)
            if isinstance(exc, SignalExit):
                redeliver(exc)
            raise
        return dict(self.tmp)

    def __exit__(self, exc_type, exc, tb):
        try:
            if exc_type is None:
                try:
                    self._commit()
                except SignalExit as sig:
                    self._cleanup()
                    exc = sig
                except BaseException:
                    self._cleanup()
                    raise
            else:
                self._cleanup()
        finally:
            self._signals.__exit__(None, None, None)
        if isinstance(exc, SignalExit):
            redeliver(exc)  # outputs untouched, temporary files gone: now end as the signal asks
        return False

    def _cleanup(self) -> None:
        for tmp in self.tmp.values():
            try:
                os.unlink(tmp)
            except OSError:
                pass

    def _commit(self) -> None:
        done = []  # (target, backup or None)
        try:
            for t in self.targets + self.remove:
                bak = _backup(t)
                done.append((t, bak))
                if t in self.tmp:
                    os.replace(self.tmp[t], t)
                elif bak is not None and os.path.lexists(t):
                    os.unlink(t)
        except BaseException as exc:
            for t, bak in reversed(done):
                try:
                    if bak is not None:
                        os.replace(bak, t)  # a no-op when both are links to one file (t never replaced) ...
                        if os.path.lexists(bak):
                            os.unlink(bak)  # ... so drop the backup name then
                    elif os.path.lexists(t):
                        os.unlink(t)
                except OSError:
                    pass
            if isinstance(exc, OSError):
                target = done[-1][0] if done else self.targets[0]
                raise FormatError(f"{target}: cannot write ({_why(exc)}); no output was changed") from None
            raise
        for _, bak in done:
            if bak is not None:
                try:
                    os.unlink(bak)
                except OSError:
                    pass


def write_bytes_to(tmp: str, target: str, chunks: Iterable) -> None:
    """Write byte chunks to ``tmp`` (the temporary file of ``target``) and fsync it."""
    try:
        with open(tmp, "wb") as fh:
            for c in chunks:
                fh.write(c)
            fh.flush()
            os.fsync(fh.fileno())
    except OSError as exc:
        raise FormatError(f"{target}: cannot write ({_why(exc)}); check free space and permissions") from None
