"""A small fake Hugging Face Hub on 127.0.0.1 for tests, plus a tiny random-weight MLX llama model to serve.

It answers the requests huggingface_hub (>= 1.0) makes for ``model_info`` / ``snapshot_download`` /
``hf_hub_download``:
  GET  /api/models/{repo}[/revision/{rev}]      -> {"id", "sha", "siblings": [{"rfilename", "size", ...}]}
  GET  /api/models/{repo}/tree/{rev}[/{path}]   -> [{"type": "file", "path", "size", "oid"}]
  HEAD/GET /{repo}/resolve/{rev}/{file}         -> the bytes, with ETag / X-Repo-Commit headers
and the Hub's error conventions (404 + ``X-Error-Code: RepoNotFound | RevisionNotFound | EntryNotFound``,
401 + ``GatedRepo`` on a gated repo's files unless ``Authorization: Bearer <repo.token>``). Every request is logged in ``FakeHub.requests`` so tests can assert "no network".
Faults: ``status`` answers every request with that HTTP error (no Hub error code, like a plain web server);
``mode = "garbage"`` answers 200 with an HTML page; ``mode = "stall"`` reads the request and never answers
(``"stall_files"`` / ``"garbage_files"``: only file downloads misbehave, the API answers).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import socket
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

TINY_REPO = "mlx-test/tiny-llama-4bit"  # the repo id the fake_hub fixture serves the tiny model under
# The tokenizer files copied from the imported bundled model; the tiny model reuses SmolLM2's vocabulary.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


def _git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class FakeRepo:
    files: dict[str, bytes]
    revisions: dict[str, str] = field(default_factory=dict)  # branch/tag -> commit sha
    gated: bool = False                                        # files need the token below
    token: str = "hf_fake_token"
    missing: set[str] = field(default_factory=set)            # listed by the API, 404 on download
    dropped: set[str] = field(default_factory=set)            # the connection dies halfway through the body
    drop_times: int = 0                                        # drop only that many times (0: always)

    def commit_for(self, rev: str) -> str | None:
        if rev in self.revisions:
            return self.revisions[rev]
        return rev if rev in self.revisions.values() else None


class FakeHub:
    """Serve repos from memory on 127.0.0.1 (a free port) until ``stop()``."""

    def __init__(self) -> None:
        self.repos: dict[str, FakeRepo] = {}
        self.requests: list[tuple[str, str]] = []
        self.connections: set = set()  # open client sockets, closed by stop() like a dying server would
        self.status: int | None = None  # set e.g. 503 to answer every request with that error (Hub outage)
        self.mode: str | None = None    # "garbage" (200 + HTML) or "stall" (never answers) for every request
        self.ranges: list[tuple[str, str]] = []  # (path, Range header) of resumed downloads
        self._stopping = threading.Event()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self.port: int | None = None

    # -- content -------------------------------------------------------------------------------------
    def add_repo(
        self,
        repo_id: str,
        files: dict[str, bytes | Path],
        *,
        revisions: tuple[str, ...] = ("main",),
        gated: bool = False,
        missing: tuple[str, ...] = (),
        dropped: tuple[str, ...] = (),
    ) -> FakeRepo:
        data = {name: (p.read_bytes() if isinstance(p, Path) else p) for name, p in files.items()}
        digest = hashlib.sha1(repo_id.encode())
        for name in sorted(data):
            digest.update(name.encode() + b"\0" + data[name])
        # Each named revision gets its own (fake) commit hash; the content is the same.
        commits = {rev: hashlib.sha1(f"{digest.hexdigest()}:{rev}".encode()).hexdigest() for rev in revisions}
        repo = FakeRepo(files=data, revisions=commits, gated=gated, missing=set(missing), dropped=set(dropped))
        self.repos[repo_id] = repo
        return repo

    def add_model_dir(self, repo_id: str, directory: Path, **kw) -> FakeRepo:
        files = {p.name: p for p in sorted(Path(directory).iterdir()) if p.is_file()}
        return self.add_repo(repo_id, files, **kw)

    # -- server --------------------------------------------------------------------------------------
    @property
    def endpoint(self) -> str:
        assert self.port is not None, "the fake Hub is not running"
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "FakeHub":
        hub = self

        class Handler(_Handler):
            fake = hub

        # Reuse the same port after a stop()/start() so a cached endpoint stays valid.
        self._stopping.clear()
        self._server = ThreadingHTTPServer(("127.0.0.1", self.port or 0), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,), name="fakehub", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving: later requests get 'connection refused', also on the client's keep-alive connections."""
        self._stopping.set()  # releases stalled handlers
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._thread.join(timeout=5)
            self._server = None
        for conn in list(self.connections):
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class _Handler(BaseHTTPRequestHandler):
    fake: FakeHub
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:  # keep test output clean
        pass

    def setup(self) -> None:
        super().setup()
        self.fake.connections.add(self.connection)

    def finish(self) -> None:
        self.fake.connections.discard(self.connection)
        super().finish()

    def do_HEAD(self) -> None:
        self._route(head=True)

    def do_GET(self) -> None:
        self._route(head=False)

    # -- helpers -------------------------------------------------------------------------------------
    def _send(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None, head=False) -> None:
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def _json(self, obj, head=False) -> None:
        self._send(200, json.dumps(obj).encode(), {"Content-Type": "application/json"}, head)

    def _error(self, status: int, code: str | None, message: str, head=False) -> None:
        headers = {"Content-Type": "application/json", "X-Error-Message": message}
        if code:
            headers["X-Error-Code"] = code
        self._send(status, json.dumps({"error": message}).encode(), headers, head)

    def _repo(self, parts: list[str], head: bool) -> tuple[str, FakeRepo | None]:
        repo_id = "/".join(parts[:2])
        repo = self.fake.repos.get(repo_id)
        if repo is None:
            self._error(404, "RepoNotFound", "Repository not found", head)
        return repo_id, repo

    def _route(self, head: bool) -> None:
        path = urlsplit(self.path).path
        self.fake.requests.append((self.command, unquote(path)))
        # Split before unquoting: a quoted revision such as refs%2Fpr%2F1 stays one segment.
        parts = [unquote(p) for p in path.split("/") if p]
        stall = self.fake.mode == "stall" or (self.fake.mode == "stall_files" and "/resolve/" in path)
        if stall:  # accept, read the request, never answer (until the fake Hub stops)
            self.fake._stopping.wait(120)
            self.close_connection = True
            return
        if self.fake.mode == "garbage" or (self.fake.mode == "garbage_files" and "/resolve/" in path):
            return self._send(200, b"<html><body>Welcome to nginx!</body></html>", {"Content-Type": "text/html"}, head)
        if self.fake.status is not None:
            return self._error(self.fake.status, None, "Service Unavailable", head)
        if parts[:2] == ["api", "models"] and len(parts) >= 4:
            self._api(parts[2:], head)
        elif len(parts) >= 5 and parts[2] == "resolve":
            self._resolve(parts, head)
        else:
            self._error(404, None, f"no route for {path}", head)

    def _api(self, parts: list[str], head: bool) -> None:
        repo_id, repo = self._repo(parts, head)
        if repo is None:
            return
        rest = parts[2:]
        if rest and rest[0] in ("revision", "tree"):
            rev = rest[1] if len(rest) > 1 else ""
        elif not rest:
            rev = "main"
        else:
            return self._error(404, None, "unknown api route", head)
        sha = repo.commit_for(rev)
        if sha is None:
            return self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}", head)
        if rest and rest[0] == "tree":
            prefix = "/".join(rest[2:])
            entries = [
                {"type": "file", "path": name, "size": len(data), "oid": _git_blob_sha1(data)}
                for name, data in sorted(repo.files.items())
                if not prefix or name.startswith(prefix + "/")
            ]
            return self._json(entries, head)
        siblings = [
            {"rfilename": name, "size": len(data), "blobId": _git_blob_sha1(data)}
            for name, data in sorted(repo.files.items())
        ]
        self._json({"id": repo_id, "modelId": repo_id, "sha": sha, "private": False, "siblings": siblings}, head)

    def _resolve(self, parts: list[str], head: bool) -> None:
        repo_id, repo = self._repo(parts, head)
        if repo is None:
            return
        if repo.gated and self.headers.get("Authorization") != f"Bearer {repo.token}":
            # Like the real Hub: a gated repo's metadata is public, its files need an accepted, logged-in user.
            return self._error(401, "GatedRepo", "Access to model is restricted. You must be authenticated.", head)
        rev, filename = parts[3], "/".join(parts[4:])
        sha = repo.commit_for(rev)
        if sha is None:
            return self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}", head)
        if filename not in repo.files or filename in repo.missing:
            return self._error(404, "EntryNotFound", f"{filename} does not exist on {rev}", head)
        data = repo.files[filename]
        headers = {
            "ETag": f'"{hashlib.sha256(data).hexdigest()}"',
            "X-Repo-Commit": sha,
            "Content-Type": "application/octet-stream",
        }
        status = 200
        rng = self.headers.get("Range")
        if rng and not head:
            self.fake.ranges.append((filename, rng))
        if rng and rng.startswith("bytes=") and not head:
            start = int(rng[6:].split("-")[0] or 0)
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
            data, status = data[start:], 206
        if filename in repo.dropped and not head:
            if repo.drop_times:
                repo.drop_times -= 1
                if not repo.drop_times:
                    repo.dropped.discard(filename)
            self.send_response(status)
            for k, v in {**headers, "Content-Length": str(len(data))}.items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(data[: len(data) // 2])
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_RDWR)
            self.close_connection = True
            return
        self._send(status, data, headers, head)


# -- the tiny model -----------------------------------------------------------------------------------
def build_tiny_llama(out_dir: Path, tokenizer_dir: Path, *, seed: int = 0) -> Path:
    """A random-weight 4-bit MLX llama with SmolLM2's 49152-token vocabulary (a few MB), saved as mlx-lm does."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.models.llama import Model, ModelArgs
    from mlx_lm.utils import save_config, save_model

    mx.random.seed(seed)
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "vocab_size": 49152,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": True,
    }
    model = Model(ModelArgs(**{k: v for k, v in config.items() if k != "architectures"}))
    nn.quantize(model, group_size=64, bits=4)
    mx.eval(model.parameters())
    config["quantization"] = {"group_size": 64, "bits": 4, "mode": "affine"}
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_model(out_dir, model)
    tok_cfg = json.loads((Path(tokenizer_dir) / "config.json").read_text())
    for key in ("bos_token_id", "eos_token_id"):
        if key in tok_cfg:
            config[key] = tok_cfg[key]
    save_config(config, out_dir / "config.json")
    for name in TOKENIZER_FILES:
        if (Path(tokenizer_dir) / name).exists():
            shutil.copy(Path(tokenizer_dir) / name, out_dir / name)
    return out_dir
