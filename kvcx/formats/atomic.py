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
- Temporary files are named after their target and their writer's pid
  (``.kvcx-<target>.<pid>.<random>.tmp``): a later run on the same target removes those whose
  writer is gone (killed with SIGKILL, say), and restores a target a dead writer had moved aside.
- The renames of one set happen under an exclusive lock on the targets' directory, so two
  processes writing the same outputs leave one's file and sidecar, never a mix of both.
- Only regular files are read (:func:`open_regular`, :func:`check_files`) or replaced: a FIFO, a
  device or a socket in an input's or an output's place is an error before any work.
"""
from __future__ import annotations

import os
import secrets
import signal
import stat
import threading

try:  # POSIX: the renames of one output set are serialised with other writers in the same directory
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None
from contextlib import contextmanager
from typing import Dict, Iterable, Iterator, List, Optional, Sequence

from kvcx.errors import FormatError, KvcxError

TMP_PREFIX = ".kvcx-"
TMP_SUFFIX = ".tmp"
BAK_SUFFIX = ".bak"
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


_KINDS = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def _not_regular(mode: int) -> str:
    for test, kind in _KINDS:
        if test(mode):
            return kind
    return "not a regular file"


def check_input_file(path, what: str = "input file") -> None:
    """FormatError unless ``path`` is an existing regular file (following links): no directory, FIFO,
    device or socket, which would block a reader or feed it endless bytes."""
    p = os.fspath(path)
    try:
        st = os.stat(p)
    except FileNotFoundError:
        raise FormatError(f"{p}: no such file; check the path") from None
    except OSError as exc:
        raise FormatError(f"{p}: cannot read the {what} ({_why(exc)})") from None
    if stat.S_ISDIR(st.st_mode):
        raise FormatError(f"{p}: is a directory, expected a {what}")
    if not stat.S_ISREG(st.st_mode):
        raise FormatError(f"{p}: is {_not_regular(st.st_mode)}, not a regular file; kvcx reads its {what} from "
                          "regular files only")


def open_regular(path, what: str = "input file"):
    """A binary file object for reading ``path``, which must be a regular file. The check is made on the
    opened descriptor (``O_NONBLOCK``: opening a FIFO does not wait for a writer), so the file cannot be
    swapped for another kind between check and use."""
    p = os.fspath(path)
    check_input_file(p, what)
    try:
        fd = os.open(p, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise FormatError(f"{p}: no such file; check the path") from None
    except PermissionError:
        raise FormatError(f"{p}: permission denied; check the file's permissions") from None
    except OSError as exc:
        raise FormatError(f"{p}: cannot read the {what} ({_why(exc)})") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise FormatError(f"{p}: is {_not_regular(st.st_mode)}, not a regular file; kvcx reads its {what} from "
                          "regular files only")
    if fcntl is not None and hasattr(os, "O_NONBLOCK"):
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    return os.fdopen(fd, "rb")


def check_output_path(path) -> None:
    """FormatError unless ``path`` can be an output file: its directory exists, and it is a regular file or
    does not exist yet (kvcx never replaces a directory, a FIFO, a device or a socket)."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise FormatError(f"{path}: the output directory {directory} does not exist; create it first")
    if os.path.isdir(path):
        raise FormatError(f"{path}: is a directory; give an output file name")
    try:
        st = os.stat(path)
    except OSError:
        return
    if not stat.S_ISREG(st.st_mode):
        raise FormatError(f"{path}: is {_not_regular(st.st_mode)}, not a regular file; kvcx writes its outputs "
                          "to regular files only: give another output path")


def check_files(reads: Iterable = (), writes: Iterable = ()) -> None:
    """The one check of everything a command touches, before any work: every file it reads (``(path, what)``:
    inputs, sidecars, plans, reused measurements, the evaluation text) is a regular file; every file it
    writes (``(path, what)``: outputs, sidecars, pictures) can be written; no output is any input, through
    any spelling or link, and no two outputs are one file."""
    reads, writes = list(reads), list(writes)
    for p, what in reads:
        check_input_file(p, what)
    for p, _ in writes:
        check_output_path(p)
    for o, _ in writes:
        for i, iwhat in reads:
            if same_path(o, i):
                raise KvcxError(f"{os.fspath(o)}: output is the {iwhat} ({os.fspath(i)}); choose another output path")
    for k, (o, _) in enumerate(writes):
        for o2, _ in writes[k + 1:]:
            if same_path(o, o2):
                raise KvcxError(f"{os.fspath(o)}: two outputs of this command are the same file ({os.fspath(o2)}); "
                                "choose another path")


def _tmp_stem(target: str) -> str:
    """``.kvcx-<target's name, at most 80 characters>.``: how this target's temporary files begin."""
    return f"{TMP_PREFIX}{os.path.basename(target)[:80]}."


def _tmp_name(target: str, suffix: str) -> str:
    directory = os.path.dirname(os.path.abspath(target))
    return os.path.join(directory, f"{_tmp_stem(target)}{os.getpid()}.{secrets.token_hex(6)}{suffix}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:   # it exists but is not ours to signal
        return True
    return True


def clear_stale(target: str) -> None:
    """Remove the temporary files a dead writer left for ``target`` (and put back a target it had moved
    aside as a backup); those of live writers stay."""
    target = os.fspath(target)
    directory = os.path.dirname(os.path.abspath(target))
    stem = _tmp_stem(target)
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        if not name.startswith(stem) or not name.endswith((TMP_SUFFIX, BAK_SUFFIX)):
            continue
        parts = name[len(stem):].split(".")
        if len(parts) != 3 or not parts[0].isdigit() or int(parts[0]) == os.getpid() or _alive(int(parts[0])):
            continue
        path = os.path.join(directory, name)
        try:
            if name.endswith(BAK_SUFFIX) and not os.path.lexists(target):
                os.replace(path, target)   # the dead writer had moved the target aside: put it back
            else:
                os.unlink(path)
        except OSError:
            pass


class _DirLock:
    """An exclusive lock on the directories of a set of targets (flock; released on close)."""

    def __init__(self, targets):
        self.fds = []
        if fcntl is None:
            return
        for d in sorted({os.path.dirname(os.path.abspath(t)) for t in targets}):
            try:
                fd = os.open(d, os.O_RDONLY)
            except OSError:
                continue
            fcntl.flock(fd, fcntl.LOCK_EX)
            self.fds.append(fd)

    def close(self):
        for fd in self.fds:
            try:
                fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)
        self.fds = []


def _create_tmp(target: str) -> str:
    directory = os.path.dirname(os.path.abspath(target))
    for _ in range(100):
        tmp = _tmp_name(target, TMP_SUFFIX)
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
    bak = _tmp_name(target, BAK_SUFFIX)
    try:
        os.link(target, bak, follow_symlinks=False)
    except OSError:
        os.replace(target, bak)  # no hard links here: rename; the target is absent until its new file lands
    return bak


class OutputSet:
    """The output files of one command: written to temporary files, then committed together."""

    def __init__(self, targets: Sequence, remove: Sequence = ()):
        self.targets: List[str] = [os.fspath(t) for t in targets]
        # removed at commit if they exist then (under the directory lock: another writer may have made one)
        self.remove: List[str] = [os.fspath(t) for t in remove]
        self.tmp: Dict[str, str] = {}
        self._signals = None

    def check(self) -> "OutputSet":
        """Fail early (before any compute) if a target cannot be written; clear what dead writers left."""
        for t in self.targets:
            check_output_path(t)
        for t in self.targets + self.remove:
            clear_stale(t)
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
        lock = _DirLock(self.targets + self.remove)
        try:
            self._replace_all()
        finally:
            lock.close()

    def _replace_all(self) -> None:
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
