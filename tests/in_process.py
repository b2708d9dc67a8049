"""The CLI's ``main()`` run inside the test process, for checks of argument parsing and input validation.

A subprocess pays ~2 s of interpreter start and mlx-lm/transformers imports for each case, and that is most of what
a parametrised list of one-line refusals costs. Here the same entry point (the one top-level error handler) runs
with the caller's argv, environment and stdin, and its stdout, stderr and exit code come back as a
``subprocess.CompletedProcess``; warnings and log records reach that stderr as in a fresh interpreter. What only a
real process shows (``sys.exit``, signals, output written by C code straight to a descriptor, closed descriptors,
anything done at import time, such as huggingface_hub reading HF_HOME and HF_HUB_OFFLINE) keeps its subprocess
tests.
"""

from __future__ import annotations

import faulthandler
import io
import logging
import os
import signal
import subprocess
import sys
import threading
import warnings

# What a fresh interpreter does with warnings (pytest records them instead): shown once per place, on stderr,
# except the categories Python ignores by default.
_PYTHON_DEFAULT_FILTERS = [
    ("default", DeprecationWarning, "__main__"),
    ("ignore", DeprecationWarning, None),
    ("ignore", PendingDeprecationWarning, None),
    ("ignore", ImportWarning, None),
    ("ignore", ResourceWarning, None),
]


def _show_warning(message, category, filename, lineno, file=None, line=None):
    sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))


def _log_to(stream) -> list:
    """Point every logging stream handler (transformers' own is bound to whatever stderr was when it was made) at
    ``stream``, and take pytest's capture handlers off the root logger so that a record no handler takes reaches
    stderr through logging's last resort, as in a fresh process. Returns what to put back."""
    root = logging.getLogger()
    undo: list = [(None, list(root.handlers))]  # (handler, its old stream); None: the root's handlers
    root.handlers = [h for h in root.handlers if not type(h).__module__.startswith("_pytest")]
    loggers = [root, *(lg for lg in logging.Logger.manager.loggerDict.values() if isinstance(lg, logging.Logger))]
    for logger in loggers:
        for h in logger.handlers:
            if type(h) is logging.StreamHandler:  # not files, not pytest's
                undo.append((h, h.stream))
                h.setStream(stream)
    return undo


def _restore_logging(undo, ours, stderr) -> None:
    """Put back what ``_log_to`` changed, and point handlers made during the call (bound to ``ours``, the call's
    stderr) at ``stderr``."""
    for handler, old in reversed(undo):
        if handler is None:
            logging.getLogger().handlers = old
        else:
            handler.setStream(old)
    for logger in [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]:
        for h in getattr(logger, "handlers", []):
            if isinstance(h, logging.StreamHandler) and h.stream is ours:
                h.setStream(stderr)


class _Buffer(io.BytesIO):
    """Stays readable after its text wrapper is dropped (which closes what it wraps)."""

    def close(self) -> None:
        pass


def run_in_process(*args: str, env: dict | None = None, input: str | bytes | None = None,
                   cwd: str | os.PathLike | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """``mlxinfer ARGS`` through ``mlxinfer.cli.main.main``; ``env`` is added to this process's environment for the
    call (MLXINFER_DEBUG is unset unless given), stdin holds ``input`` (empty when None, as /dev/null would), and
    ``cwd`` is the working directory during the call.
    stdout/stderr are text (undecodable bytes replaced), or bytes when ``input`` is bytes, as ``safety_cli.run``.
    A runaway input must fail, not hang CI, as a subprocess would be killed: after ``timeout`` seconds the call is
    interrupted as by Ctrl-C (the CLI then exits 130, with a note on its stderr), and if it is stuck in C code the
    whole test run ends after twice that, with every thread's traceback."""
    from mlxinfer.cli import main as cli

    data = input.encode() if isinstance(input, str) else (input or b"")
    out, err = _Buffer(), _Buffer()
    saved_env, saved_cwd = dict(os.environ), os.getcwd()
    saved_streams, saved_argv = (sys.stdin, sys.stdout, sys.stderr), sys.argv
    # main() installs SIGTERM/SIGHUP handlers as in a real run; pytest's own are put back afterwards.
    saved_signals = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)}
    os.environ.pop("MLXINFER_DEBUG", None)
    os.environ.update({k: str(v) for k, v in (env or {}).items()})
    streams = (io.TextIOWrapper(io.BytesIO(data), encoding="utf-8"),
               io.TextIOWrapper(out, encoding="utf-8", write_through=True),
               io.TextIOWrapper(err, encoding="utf-8", write_through=True))
    sys.stdin, sys.stdout, sys.stderr = streams
    sys.argv = ["mlxinfer", *map(str, args)]  # click names the program after it in usage lines
    logging_undo = _log_to(streams[2])
    timed_out: list[bool] = []

    def interrupt() -> None:
        timed_out.append(True)
        import _thread

        _thread.interrupt_main()

    watchdog = threading.Timer(timeout, interrupt)
    watchdog.start()
    faulthandler.dump_traceback_later(2 * timeout, exit=True, file=sys.__stderr__)
    try:
        if cwd is not None:
            os.chdir(cwd)
        with warnings.catch_warnings():
            warnings.resetwarnings()
            for action, category, module in reversed(_PYTHON_DEFAULT_FILTERS):
                warnings.filterwarnings(action, category=category, module=module or "")
            warnings.showwarning = _show_warning
            code = cli.main([str(a) for a in args])
        if timed_out:
            print(f"run_in_process: still running after {timeout} s, interrupted", file=sys.stderr)
    finally:
        watchdog.cancel()
        faulthandler.cancel_dump_traceback_later()
        sys.stdin, sys.stdout, sys.stderr = saved_streams
        sys.argv = saved_argv
        os.chdir(saved_cwd)
        _restore_logging(logging_undo, streams[2], saved_streams[2])
        for stream in streams:
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os.environ.clear()
        os.environ.update(saved_env)
        for s, handler in saved_signals.items():
            signal.signal(s, handler)
        cli._SIGNALS.clear()
    stdout, stderr = out.getvalue(), err.getvalue()
    if not isinstance(input, bytes):
        stdout, stderr = stdout.decode("utf-8", "replace"), stderr.decode("utf-8", "replace")
    return subprocess.CompletedProcess(["mlxinfer", *map(str, args)], code, stdout, stderr)
