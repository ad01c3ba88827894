"""Where the engine's logs go: a log file per command; the terminal only with ``--verbose``.

vLLM, torch and transformers log at INFO/WARNING while an engine starts (about
30 lines on CPU). A command that runs the engine wraps its work in
:func:`session`; inside it

* every log record at INFO and above (vLLM's, ours, anyone's that reaches the
  root logger) is appended to ``$LADSD_HOME/logs/<command>-<time>-<pid>.log``
  (removed at the end if nothing was written to it);
* Python warnings (e.g. torch's FutureWarnings) become log records; those
  raised from ladsd's own code count as ladsd's warnings;
* a thread that dies of an exception is logged as an error;
* the terminal (stderr) gets errors from anyone and ladsd's own warnings, or
  every record with ``verbose=True``;
* unless ``verbose``, file descriptor 2 itself points at the log file, so what
  is printed straight to stderr (torch's own handlers, C/C++ notes such as
  torch's ``NUMA binding`` line) is kept there and not shown.

Our own progress and results go to stdout (rich), which is never redirected.

vLLM installs its own stdout handler unless ``VLLM_CONFIGURE_LOGGING=0``;
:func:`session` sets that (vLLM reads it when it builds an engine) unless the
user set ``VLLM_CONFIGURE_LOGGING`` or ``VLLM_LOGGING_CONFIG_PATH``, in which
case vLLM's logging is left as they asked. ``VLLM_LOGGING_LEVEL`` still sets
the level of vLLM's loggers. Everything is restored when the session ends.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from ladsd.config import ladsd_home

FILE_FORMAT = "%(asctime)s %(levelname)s [%(name)s] %(message)s"
TERMINAL_FORMAT = "%(levelname)s [%(name)s] %(message)s"
OWN = ("ladsd", "cli", "web_catalog")  # logger-name prefixes and packages that are ours
_ROOT = Path(__file__).resolve().parents[1]
_OWN_DIRS = tuple(str(_ROOT / p) + os.sep for p in OWN)


@dataclass(frozen=True)
class LogSession:
    path: Path  # the log file of this command
    verbose: bool


def log_dir() -> Path:
    return ladsd_home() / "logs"


def _is_own(name: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in OWN)


def to_file(message: str, exc: BaseException | None = None) -> None:
    """Record ``message`` (and the traceback of ``exc``) in the log file only.

    For failures the command already reports on the terminal in one line.
    """
    logging.getLogger("ladsd").error(message, exc_info=exc, extra={"file_only": True})


class _FileOnly(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not getattr(record, "file_only", False)


class _TerminalFilter(logging.Filter):
    """Quiet mode: errors from anyone, warnings only from ladsd itself."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR:
            return True
        return record.levelno >= logging.WARNING and _is_own(record.name)


class _Terminal(logging.Handler):
    """Writes to ``stream``, or (None) to whatever ``sys.stderr`` is at the time
    (rich's live progress redirects it to print above the bar)."""

    def __init__(self, stream: TextIO | None) -> None:
        super().__init__()
        self.stream = stream

    def emit(self, record: logging.LogRecord) -> None:
        try:
            out = self.stream if self.stream is not None else sys.stderr
            out.write(self.format(record) + "\n")
            out.flush()
        except Exception:  # never let logging break the command
            self.handleError(record)


def _showwarning(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    file: TextIO | None = None,
    line: str | None = None,
) -> None:
    text = warnings.formatwarning(message, category, filename, lineno, line).rstrip()
    own = os.path.abspath(filename).startswith(_OWN_DIRS)
    logging.getLogger("ladsd.warnings" if own else "py.warnings").warning("%s", text)


def _new_path(command: str) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    name = f"{command}-{stamp}-{os.getpid()}.log"
    for folder in (log_dir(), Path(tempfile.gettempdir()) / "ladsd-logs"):
        try:
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / name
            path.touch()
            return path
        except OSError:
            continue
    raise OSError(f"cannot create a log file {name} under {log_dir()} or the temp dir")


def _drop_if_empty(path: Path) -> None:
    try:
        if path.stat().st_size == 0:
            path.unlink()
    except OSError:
        pass


@contextmanager
def _env(values: dict[str, str]) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextmanager
def _logger(name: str, level: int | None, take_over: bool) -> Iterator[None]:
    """Let ``name`` propagate to the root handlers (and set its level) for the session."""
    lg = logging.getLogger(name)
    saved = (list(lg.handlers), lg.level, lg.propagate)
    if take_over:
        for h in saved[0]:
            lg.removeHandler(h)
        lg.propagate = True
    if level is not None:
        lg.setLevel(level)
    try:
        yield
    finally:
        if take_over:
            for h in list(lg.handlers):
                lg.removeHandler(h)
            for h in saved[0]:
                lg.addHandler(h)
        lg.setLevel(saved[1])
        lg.propagate = saved[2]


@contextmanager
def _stderr_fd_to(path: Path) -> Iterator[TextIO]:
    """Point fd 2 (and so ``sys.stderr``) at ``path``; yield a stream on the old fd 2."""
    try:
        sys.stderr.flush()
    except (AttributeError, ValueError, OSError):
        pass
    saved = os.dup(2)
    term = os.fdopen(os.dup(saved), "w", buffering=1, errors="backslashreplace")
    with open(path, "ab", buffering=0) as log:
        os.dup2(log.fileno(), 2)
    try:
        yield term
    finally:
        try:
            sys.stderr.flush()
        except (AttributeError, ValueError, OSError):
            pass
        os.dup2(saved, 2)
        os.close(saved)
        term.close()


def _thread_excepthook(args: threading.ExceptHookArgs) -> None:
    """A thread that dies of an exception: an error record (shown), not a bare stderr print."""
    if args.exc_type is SystemExit:
        return
    name = args.thread.name if args.thread is not None else "?"
    logging.getLogger("ladsd.thread").error(
        "thread %s died", name, exc_info=(args.exc_type, args.exc_value, args.exc_traceback)
    )


@contextmanager
def session(command: str, verbose: bool = False) -> Iterator[LogSession]:
    """Route third-party logs to a log file (and, if ``verbose``, to the terminal).

    Enter it before vLLM is imported (then its import-time warnings are caught
    too); it works, less completely, after.
    """
    path = _new_path(command)
    user_vllm = any(k in os.environ for k in ("VLLM_CONFIGURE_LOGGING", "VLLM_LOGGING_CONFIG_PATH"))
    vllm_level = logging.getLevelName(os.environ.get("VLLM_LOGGING_LEVEL", "INFO").upper())
    if not isinstance(vllm_level, int):
        vllm_level = logging.INFO
    root = logging.getLogger()
    file_handler = logging.FileHandler(path, encoding="utf-8")
    file_handler.setFormatter(logging.Formatter(FILE_FORMAT))
    with ExitStack() as stack:
        stack.callback(_drop_if_empty, path)  # runs last
        if not user_vllm:
            stack.enter_context(_env({"VLLM_CONFIGURE_LOGGING": "0"}))
        if verbose:
            terminal = _Terminal(None)
        else:
            terminal = _Terminal(stack.enter_context(_stderr_fd_to(path)))
            terminal.addFilter(_TerminalFilter())
        terminal.setFormatter(logging.Formatter(TERMINAL_FORMAT))
        terminal.addFilter(_FileOnly())
        stack.callback(root.setLevel, root.level)
        root.addHandler(file_handler)
        root.addHandler(terminal)
        root.setLevel(logging.INFO)
        stack.callback(file_handler.close)
        stack.callback(root.removeHandler, file_handler)
        stack.callback(root.removeHandler, terminal)
        stack.enter_context(_logger("vllm", vllm_level, take_over=not user_vllm))
        stack.callback(setattr, warnings, "showwarning", warnings.showwarning)
        warnings.showwarning = _showwarning
        stack.callback(setattr, threading, "excepthook", threading.excepthook)
        threading.excepthook = _thread_excepthook
        yield LogSession(path, verbose)
