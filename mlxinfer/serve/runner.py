"""Run the app on uvicorn: checks before the model loads (address, key, port), a graceful drain on
SIGTERM/SIGINT/SIGHUP."""

from __future__ import annotations

import contextlib
import signal
import socket
import threading
import time

from ..errors import InvalidParameter
from .app import ServeOptions, create_app
from .guard import GuardedH11, is_loopback_name, raise_descriptor_limit

FORCE_AFTER_S = 3.0  # after a second signal: how long the running requests get to end with their error event


def check_bind(host: str, port: int, api_key: str | None) -> int:
    """Refuse what should not start: a non-loopback address without an API key, a port that is taken. Returns
    the port to serve on: ``port``, or for 0 the free one the system gave the probe (announced, then bound)."""
    if not host.strip():
        raise InvalidParameter("empty --host", hint="give an address, e.g. 127.0.0.1 (the default) or 0.0.0.0")
    if not is_loopback_name(host) and not api_key:
        raise InvalidParameter(f"refusing to listen on {host} without an API key",
                               hint="pass --api-key KEY (or set MLXINFER_API_KEY), or bind 127.0.0.1")
    if not 0 <= port <= 65535:
        raise InvalidParameter(f"invalid port {port}: must be between 0 and 65535")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise InvalidParameter(f"cannot resolve the address {host!r} ({e.strerror})", hint="check --host") from None
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(addr)
        except OSError as e:
            raise InvalidParameter(f"cannot listen on {host}:{port} ({e.strerror})",
                                   hint="choose another --port, or stop what uses it") from None
        return probe.getsockname()[1]


def serve(loaded, opts: ServeOptions, *, host: str, port: int, grace: float, log_level: str = "warning") -> None:
    """Serve until SIGTERM/SIGINT/SIGHUP; then stop accepting, let running requests finish within ``grace`` seconds and
    return (the command exits 0)."""
    import uvicorn

    app = create_app(loaded, opts)
    engine = app.state.api.engine

    class Server(uvicorn.Server):
        ending_now = False

        def handle_exit(self, sig, frame):
            if self.should_exit and self.ending_now:  # a third signal: out now, whatever is running
                self.force_exit = True
            elif self.should_exit:
                # A second signal, whatever it is: the running requests end at their next token with the 503
                # error event (uvicorn's forced exit cut streams mid-chunk and logged two tracebacks); a step that
                # does not come back within FORCE_AFTER_S is left behind.
                self.ending_now = True
                engine.end_all_at(time.perf_counter())
                timer = threading.Timer(FORCE_AFTER_S, setattr, (self, "force_exit", True))
                timer.daemon = True
                timer.start()
                return
            else:
                engine.draining = True  # requests arriving on open connections get 503 from now on
                # Requests still running a second before --grace runs out end with a 503 error event (a stream
                # then closes properly) instead of being cut by uvicorn's cancellation.
                engine.end_all_at(time.perf_counter() + max(0.0, grace - 1.0))
            super().handle_exit(sig, frame)

        @contextlib.contextmanager
        def capture_signals(self):
            # uvicorn takes SIGINT and SIGTERM; a hangup (the terminal that started the server closed) drains the
            # same way instead of raising the CLI's Terminated inside the event loop (a traceback, exit 129).
            hup = getattr(signal, "SIGHUP", None)
            previous = signal.signal(hup, self.handle_exit) if hup is not None else None
            try:
                with super().capture_signals():
                    yield
                    # A drained shutdown is the clean end of a server, not a signal to re-raise.
                    self._captured_signals.clear()
            finally:
                if hup is not None:
                    signal.signal(hup, previous)

    raise_descriptor_limit()
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                            access_log=log_level in ("info", "debug", "trace"),
                            timeout_graceful_shutdown=grace, http=GuardedH11)
    Server(config).run()
