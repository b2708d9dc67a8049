"""The guards below the routes (serve/guard.py): uvicorn with ``GuardedH11`` on a trivial app in this process
(a short header deadline and a small connection cap patched in), and the browser checks on the real server."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest
from serve_helpers import assert_openai_error, free_port

from mlxinfer.serve import guard


@pytest.fixture()
def guarded(monkeypatch):
    """uvicorn with GuardedH11 on a 'hello' app: (host, port)."""
    import uvicorn

    monkeypatch.setattr(guard, "HEADER_TIMEOUT", 0.5)
    monkeypatch.setattr(guard, "MAX_CONNECTIONS", 16)  # the smallest cap there is

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"5")]})
        await send({"type": "http.response.body", "body": b"hello"})

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error", lifespan="off",
                                           http=guard.GuardedH11, timeout_keep_alive=30))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    yield "127.0.0.1", port
    server.should_exit = True
    thread.join(10)


def _response(sock: socket.socket) -> bytes:
    data = b""
    sock.settimeout(5)
    while not data.endswith(b"hello"):
        chunk = sock.recv(1024)
        assert chunk, data
        data += chunk
    return data


def _closed(sock: socket.socket, within: float) -> bool:
    """Whether the server closes ``sock`` within ``within`` seconds (recv returns b"")."""
    sock.settimeout(within)
    try:
        return sock.recv(1024) == b""
    except socket.timeout:
        return False
    except ConnectionResetError:
        return True


def test_a_request_head_that_never_completes_is_closed(guarded):
    with socket.create_connection(guarded) as idle, socket.create_connection(guarded) as trickle:
        trickle.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")
        for _ in range(3):  # bytes keep coming, the head never ends: the deadline still holds
            time.sleep(0.2)
            trickle.sendall(b"X-A: b\r\n")
        assert _closed(idle, 2) and _closed(trickle, 2)
    assert httpx.get(f"http://{guarded[0]}:{guarded[1]}/").text == "hello"  # whole requests are served


def test_a_keep_alive_connection_gets_the_same_deadline_for_its_next_request(guarded):
    with socket.create_connection(guarded) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert _response(sock).startswith(b"HTTP/1.1 200")
        time.sleep(0.3)
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")  # well within the deadline of the second head
        assert _response(sock).startswith(b"HTTP/1.1 200")
        sock.sendall(b"GET / HTTP/1.1\r\n")  # a third head, never finished
        assert _closed(sock, 2)


def test_connections_over_the_cap_are_closed_at_once(guarded):
    held = [socket.create_connection(guarded) for _ in range(16)]
    try:
        extra = socket.create_connection(guarded)
        assert _closed(extra, 0.3)  # well before the header deadline
        extra.close()
    finally:
        for sock in held:
            sock.close()
    time.sleep(0.1)
    assert httpx.get(f"http://{guarded[0]}:{guarded[1]}/").text == "hello"  # room again once they are gone


def test_the_descriptor_limit_is_raised_for_the_cap():
    import resource

    guard.raise_descriptor_limit()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert soft == resource.RLIM_INFINITY or soft >= min(4 * guard.MAX_CONNECTIONS, hard)
    assert guard.connection_cap() <= guard.MAX_CONNECTIONS


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8080", "192.168.1.5", "[fe80::1]:80"])
def test_a_loopback_server_without_a_key_refuses_other_host_names(server, host):
    """DNS rebinding: a page at evil.example whose name now points at 127.0.0.1 must not read the API."""
    for method, path in (("GET", "/v1/models"), ("POST", "/v1/chat/completions")):
        r = httpx.request(method, server.url(path), headers={"Host": host}, json={"messages": []}, timeout=10)
        assert_openai_error(r, 403, "host_not_allowed")


@pytest.mark.parametrize("host", ["localhost", "localhost:1234", "127.0.0.1", "127.0.0.5:80", "[::1]:8080",
                                  "app.localhost"])
def test_this_machines_names_are_answered(server, host):
    assert httpx.get(server.url("/v1/models"), headers={"Host": host}, timeout=10).status_code == 200


def test_pages_from_origins_not_allowed_are_refused(server, limited):
    """A browser POSTs cross-site without a preflight when the type is text/plain; its Origin header gives it
    away. curl and SDKs send no Origin and are not affected."""
    body = '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}'
    r = httpx.post(server.url("/v1/chat/completions"), content=body, timeout=30,
                   headers={"Origin": "https://evil.example", "Content-Type": "text/plain"})
    err = assert_openai_error(r, 403, "origin_not_allowed")
    assert "--allow-origin https://evil.example" in err["message"]
    r = httpx.post(limited.url("/v1/chat/completions"), content=body, timeout=30,
                   headers={**limited.headers(), "Origin": "https://evil.example"})
    assert_openai_error(r, 403, "origin_not_allowed")  # a key does not change that
    r = httpx.post(limited.url("/v1/chat/completions"), content=body, timeout=60,
                   headers={**limited.headers(), "Origin": "http://ui.example"})
    assert r.status_code == 200, r.text  # the page --allow-origin names
    assert r.headers["access-control-allow-origin"] == "http://ui.example"
