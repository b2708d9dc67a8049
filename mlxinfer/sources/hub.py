"""Hugging Face Hub source: download only what an MLX model needs, and re-use the local cache when offline.

Everything goes through the real ``huggingface_hub`` client and its standard cache (``$HF_HOME/hub``), so models
downloaded here are shared with mlx-lm, transformers and ``hf download``. Only safetensors weights, JSON configs and
tokenizer files are fetched: pickle weights are never loaded and remote code (``*.py``) is never downloaded.
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Callable

from ..errors import DownloadError, InvalidModel, MlxinferError, ModelNotFound

Progress = Callable[[str, int, int], None]

# What an MLX model directory needs; top-level files only (subfolders such as original/ hold other formats).
# Weights are model*.safetensors, the files mlx-lm loads: a top-level consolidated.safetensors is a duplicate.
ALLOW_PATTERNS = ["model*.safetensors", "*.json", "tokenizer.model", "*.tiktoken", "*.txt", "*.jinja"]
IGNORE_PATTERNS = ["*/*"]
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
_TRUE = {"1", "ON", "YES", "TRUE"}
DEFAULT_TIMEOUT = 10.0  # seconds to connect, or to wait for the next bytes, per request
STALL_REQUESTS = 2      # silent for this many timeouts: give up rather than retry (10 s each: ~30 s at most)
_PRECHECK = ("config.json", "tokenizer_config.json")  # read before any weights are fetched


# -- environment, read on every call: huggingface_hub reads it once at import, tests and the CLI change it later --
def hub_cache_dir() -> Path:
    """The Hub cache folder huggingface_hub would use with the current environment."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return Path(os.path.expandvars(os.environ[var])).expanduser()
    return hf_home() / "hub"


def hf_home() -> Path:
    if os.environ.get("HF_HOME"):
        return Path(os.path.expandvars(os.environ["HF_HOME"])).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "huggingface"


def hub_offline() -> bool:
    return (os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or "").upper() in _TRUE


def hub_endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")


def _token() -> str | None:
    """HF_TOKEN, else the token saved by ``hf auth login`` (HF_TOKEN_PATH or HF_HOME/token), else the library's."""
    if os.environ.get("HF_TOKEN"):
        return os.environ["HF_TOKEN"].strip()
    saved = Path(os.environ.get("HF_TOKEN_PATH") or hf_home() / "token").expanduser()
    try:
        return saved.read_text().strip() or None
    except OSError:
        return None


@contextlib.contextmanager
def _quiet_hub_logs():
    """Silence huggingface_hub's own warnings (retries, resumes) so a failure surfaces as one MlxinferError line;
    MLXINFER_DEBUG=1 keeps them."""
    if os.environ.get("MLXINFER_DEBUG"):
        yield
        return
    logger = logging.getLogger("huggingface_hub")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _label(repo: str, revision: str | None) -> str:
    return repo + (f"@{revision}" if revision else "")


# -- timeouts -----------------------------------------------------------------------------------------------
def hub_timeout() -> float:
    """Seconds a Hub request may take to connect or between received bytes (MLXINFER_HUB_TIMEOUT, default 10)."""
    try:
        value = float(os.environ.get("MLXINFER_HUB_TIMEOUT") or DEFAULT_TIMEOUT)
    except ValueError:
        return DEFAULT_TIMEOUT
    return value if 0 < value < 3600 else DEFAULT_TIMEOUT


class HubStalled(Exception):
    """The Hub has sent nothing for STALL_REQUESTS timeouts; raised instead of letting huggingface_hub retry on."""


class _Watch:
    """When the Hub last answered, while a download_model call is running (None otherwise)."""

    since: float | None = None


def _bound_request(request) -> None:
    """httpx request hook: cap every timeout (huggingface_hub passes None, i.e. wait forever, for its API calls)
    and stop retrying once the Hub has been silent for too long."""
    limit = hub_timeout()
    since = _Watch.since
    if since is not None and time.monotonic() - since > STALL_REQUESTS * limit:
        raise HubStalled(f"{hub_endpoint()} sent nothing for {STALL_REQUESTS * limit:g} s")
    timeouts = dict(request.extensions.get("timeout") or {})
    for key in ("connect", "read", "write", "pool"):
        if timeouts.get(key) is None or timeouts[key] > limit:
            timeouts[key] = limit
    request.extensions = {**request.extensions, "timeout": timeouts}


def _answered(*_args) -> None:
    if _Watch.since is not None:
        _Watch.since = time.monotonic()


def _client_factory():
    try:  # huggingface_hub's own client (its offline-mode hook, redirects), plus ours
        from huggingface_hub.utils._http import default_client_factory

        client = default_client_factory()
    except ImportError:
        import httpx2

        client = httpx2.Client(follow_redirects=True, timeout=None)
    hooks = client.event_hooks
    client.event_hooks = {"request": [*hooks["request"], _bound_request], "response": [*hooks["response"], _answered]}
    return client


_installed = False


def _install_timeouts() -> None:
    """Make huggingface_hub's shared HTTP client (also used by transformers) apply the timeouts above."""
    global _installed
    if not _installed:
        from huggingface_hub import set_client_factory

        set_client_factory(_client_factory)
        _installed = True


# -- progress ---------------------------------------------------------------------------------------------
class _ByteProgress:
    """Turns huggingface_hub's tqdm bars into ``progress("download", done_bytes, total_bytes)`` calls.

    snapshot_download drives several bars (files done, bytes received, bytes written); every bar counted in bytes
    measures the same download, so the furthest one is the progress. Called from download worker threads.
    """

    def __init__(self, callback: Progress | None, total: int):
        self.callback = callback
        self.total = total
        self.done = 0
        self._reported = False
        self._lock = threading.Lock()

    def report(self, n: int) -> None:
        with self._lock:
            if n <= self.done:
                return
            self.done = min(n, self.total) if self.total else n
            self._reported = True
            _answered()
            if self.callback is not None:
                self.callback("download", self.done, max(self.total, self.done))

    def finish(self) -> None:
        """Report completion once (also when every file came from the cache and no bytes moved)."""
        with self._lock:
            if self._reported and self.done >= self.total:
                return
            self.done, self._reported = self.total, True
        if self.callback is not None:
            self.callback("download", self.total, self.total)

    def bar_class(self) -> type:
        tracker = self

        class _Bar:
            """Just enough of tqdm's interface for huggingface_hub; draws nothing."""

            def __init__(self, *args, **kwargs):
                self.n = kwargs.get("initial") or 0
                self.total = kwargs.get("total")
                self.unit = kwargs.get("unit", "it")
                self.desc = kwargs.get("desc", "")
                self.format_dict = {"rate": None, "n": self.n, "total": self.total}

            def update(self, n: int | float | None = 1) -> None:
                self.n += int(n or 0)
                if self.unit == "B":
                    tracker.report(self.n)

            def __enter__(self):
                return self

            def __exit__(self, *exc) -> None:
                pass

            def __iter__(self):
                return iter(())

            def _noop(self, *args, **kwargs) -> None:
                pass

            close = refresh = clear = set_description = set_description_str = set_postfix = _noop
            set_postfix_str = reset = display = unpause = _noop

        return _Bar


# -- errors -----------------------------------------------------------------------------------------------
def _reason(err: BaseException) -> str:
    """A short, one-line cause for a failed Hub request."""
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    import httpx2

    if isinstance(err, OfflineModeIsEnabled):
        return "HF_HUB_OFFLINE is set"
    if isinstance(err, HfHubHTTPError) and err.response is not None:
        return f"{hub_endpoint()} answered HTTP {err.response.status_code}"
    if isinstance(err, httpx2.TimeoutException):
        return f"{hub_endpoint()} did not answer within {hub_timeout():g} s"
    if isinstance(err, HubStalled):
        return str(err)
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return f"{hub_endpoint()}: {text}"


def _translate(err: BaseException, repo: str, revision: str | None) -> MlxinferError:
    """One clear MlxinferError for a huggingface_hub / network failure."""
    import httpx2
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        HFValidationError,
        LocalEntryNotFoundError,
        RemoteEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    label = _label(repo, revision)
    login = "run 'hf auth login' or set HF_TOKEN"
    if isinstance(err, HFValidationError):
        return ModelNotFound(f"'{repo}' is not a valid Hub repo id", hint="use the form org/name[@revision]")
    if isinstance(err, GatedRepoError):
        return DownloadError(
            f"Hub repo '{repo}' is gated: accept its terms at {hub_endpoint()}/{repo}, then log in", hint=login
        )
    if isinstance(err, RepositoryNotFoundError):
        return ModelNotFound(
            f"Hub repo '{repo}' not found at {hub_endpoint()}",
            hint=f"check the repo id; if it is private or gated, {login}",
        )
    if isinstance(err, RevisionNotFoundError):
        return ModelNotFound(
            f"revision '{revision or 'main'}' not found in Hub repo '{repo}'", hint="check the branch, tag or commit"
        )
    if isinstance(err, RemoteEntryNotFoundError):
        url = str(err.response.url) if err.response is not None else ""
        name = url.split("/resolve/", 1)[-1].split("/", 1)[-1] if "/resolve/" in url else "a file"
        return DownloadError(
            f"{label}: file '{name}' is listed by the Hub but cannot be downloaded (404)",
            hint="the repo may be changing; try again, or pin a revision with org/name@commit",
        )
    if isinstance(err, HfHubHTTPError) and err.response is not None and err.response.status_code in (401, 403):
        return DownloadError(f"not authorized to download {label} ({_reason(err)}): it is private or gated", hint=login)
    if isinstance(err, HfHubHTTPError):
        return _http_error(err, label)
    if isinstance(err, (json.JSONDecodeError, UnicodeDecodeError)):
        return _not_understood(label)
    if isinstance(err, (LocalEntryNotFoundError, httpx2.HTTPError, ConnectionError, TimeoutError, HubStalled)):
        cause = err.__cause__ or err
        return DownloadError(
            f"download of {label} failed: the Hub cannot be reached ({_reason(cause)})",
            hint="check the connection and run again; finished files are kept",
        )
    if isinstance(err, OSError):
        return DownloadError(f"cannot write to the Hugging Face cache {hub_cache_dir()}: {err.strerror or err}")
    raise err


def _http_error(err, label: str) -> MlxinferError:
    """An HTTP error status without a Hub error code: the hint follows the status class."""
    status = err.response.status_code if err.response is not None else 0
    where = f"{hub_endpoint()} answered HTTP {status}"
    if status == 404:
        return ModelNotFound(f"{label}: {where}: no such repo or revision there",
                             hint="check the repo id, the revision and HF_ENDPOINT")
    if status == 429:
        return DownloadError(f"download of {label} failed: {where} (too many requests)", hint="wait and try again")
    if status >= 500:
        return DownloadError(f"download of {label} failed: {where}, a server error",
                             hint="try again later, or set HF_HUB_OFFLINE=1 to use the cache")
    return DownloadError(f"download of {label} failed: {where}", hint="check the repo id and HF_ENDPOINT")


def _not_understood(label: str) -> MlxinferError:
    return DownloadError(f"{hub_endpoint()} answered the request for {label} with something that is not the "
                         "Hugging Face Hub API", hint="check HF_ENDPOINT, or a proxy in between")


# -- repo contents ----------------------------------------------------------------------------------------
def _is_weights(name: str) -> bool:
    return fnmatch.fnmatch(name, "model*.safetensors")


def _wanted(name: str) -> bool:
    return "/" not in name and any(fnmatch.fnmatch(name, p) for p in ALLOW_PATTERNS)


def _check_listing(repo: str, revision: str | None, names: list[str]) -> None:
    """Refuse repos we cannot load, before anything is downloaded."""
    label = _label(repo, revision)
    top = [n for n in names if "/" not in n]
    if not any(_is_weights(n) for n in top):
        pickles = sorted(n for n in names if n.lower().endswith(PICKLE_SUFFIXES))
        if pickles:
            shown = ", ".join(pickles[:3]) + (", ..." if len(pickles) > 3 else "")
            raise MlxinferError(
                f"{label} has only pickle weights ({shown}); mlxinfer never loads pickle files",
                hint="convert it with 'mlxinfer convert' from a safetensors source, or pick an mlx-community repo",
            )
        if any(n.lower().endswith(".gguf") for n in names):
            raise InvalidModel(
                f"{label} has GGUF files but no safetensors weights",
                hint="download the .gguf file and pass its path, e.g. 'mlxinfer generate ./model.gguf'",
            )
        raise InvalidModel(
            f"{label} has no model*.safetensors weights", hint="it is not an MLX/Transformers model repo"
        )
    if "config.json" not in top:
        raise InvalidModel(f"{label} has no config.json", hint="it is not an MLX/Transformers model repo")


def _check_dir(path: Path, label: str) -> Path:
    if not (path / "config.json").is_file() or not any(path.glob("model*.safetensors")):
        raise InvalidModel(
            f"the downloaded copy of {label} has no config.json or no model*.safetensors ({path})",
            hint="it is not an MLX/Transformers model repo",
        )
    return path


# -- public API -------------------------------------------------------------------------------------------
def _snapshot(repo: str, revision: str | None, **kw) -> Path:
    from huggingface_hub import snapshot_download

    return Path(
        snapshot_download(
            repo,
            revision=revision,
            cache_dir=hub_cache_dir(),
            endpoint=hub_endpoint(),
            token=_token(),
            allow_patterns=ALLOW_PATTERNS,
            ignore_patterns=IGNORE_PATTERNS,
            library_name="mlxinfer",
            **kw,
        )
    )


def cached_path(repo: str, revision: str | None = None) -> Path | None:
    """The cached snapshot directory of ``repo`` at ``revision`` if it is complete on disk; no network."""
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        path = _snapshot(repo, revision, local_files_only=True)
    except (LocalEntryNotFoundError, HFValidationError, OSError):
        return None
    if (path / "config.json").is_file() and any(path.glob("model*.safetensors")):
        return path
    return None


def _from_cache(repo: str, revision: str | None, reason: str, cause: BaseException | None, *,
                garbled: bool = False) -> Path:
    """The cached snapshot when the Hub cannot serve it; otherwise one line whose hint matches why."""
    from huggingface_hub.errors import HFValidationError, IncompleteSnapshotError, LocalEntryNotFoundError

    label = _label(repo, revision)
    status = getattr(getattr(cause, "response", None), "status_code", 0) or 0
    if cause is None:  # offline mode
        why, fix = "offline mode is on (HF_HUB_OFFLINE is set)", "unset HF_HUB_OFFLINE to download it"
    elif garbled:
        why, fix = f"{hub_endpoint()} answered with something that is not the Hugging Face Hub API", \
            "check HF_ENDPOINT, or a proxy or login page in between"
    elif status >= 500:
        why, fix = f"the Hub had a server error ({reason})", "try again later"
    else:
        why, fix = f"the Hub cannot be reached ({reason})", "connect once or set HF_ENDPOINT"
    try:
        path = _snapshot(repo, revision, local_files_only=True)
    except IncompleteSnapshotError:
        raise DownloadError(
            f"the cached copy of {label} is incomplete and {why}",
            hint="unset HF_HUB_OFFLINE to finish it" if cause is None else "connect once to finish the download",
        ) from cause
    except LocalEntryNotFoundError:
        raise DownloadError(f"{label} is not in the local cache and {why}; {fix}") from cause
    except HFValidationError as e:
        raise _translate(e, repo, revision) from None
    return _check_dir(path, label)


def download_model(repo: str, revision: str | None = None, *, progress: Progress | None = None) -> Path:
    """Download (or find in the cache) the MLX files of a Hub model repo; returns the snapshot directory.

    ``progress("download", done_bytes, total_bytes)`` is called from worker threads while files arrive and once
    at the end with done == total (also when everything was already cached). Nothing is called when offline.
    Honours HF_HOME / HF_HUB_CACHE, HF_HUB_OFFLINE, HF_ENDPOINT and HF_TOKEN as set at call time.
    """
    import httpx2
    from huggingface_hub import HfApi
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        HFValidationError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )
    from huggingface_hub.utils import validate_repo_id

    revision = revision or None
    try:
        validate_repo_id(repo)
    except HFValidationError as e:
        raise _translate(e, repo, revision) from None
    if hub_offline():
        return _from_cache(repo, revision, "HF_HUB_OFFLINE is set", None)

    _install_timeouts()
    _Watch.since = time.monotonic()
    try:
        api = HfApi(endpoint=hub_endpoint(), token=_token(), library_name="mlxinfer")
        try:
            info = api.model_info(repo, revision=revision, files_metadata=True, timeout=hub_timeout())
            siblings = [(s.rfilename, s.size) for s in info.siblings or []]
        except httpx2.ProxyError as e:
            raise _translate(e, repo, revision) from None
        except (httpx2.ConnectError, httpx2.TimeoutException, httpx2.RemoteProtocolError, OfflineModeIsEnabled,
                HubStalled) as e:
            return _from_cache(repo, revision, _reason(e), e)
        except (RepositoryNotFoundError, GatedRepoError, RevisionNotFoundError) as e:
            raise _translate(e, repo, revision) from None
        except HfHubHTTPError as e:
            if e.response is not None and e.response.status_code >= 500:  # Hub down: the cache may still serve
                return _from_cache(repo, revision, _reason(e), e)
            raise _translate(e, repo, revision) from None
        except (ValueError, TypeError, KeyError, AttributeError) as e:  # an answer that is not the Hub's JSON
            return _from_cache(repo, revision, "", e, garbled=True)

        _check_listing(repo, revision, [name for name, _ in siblings])
        tracker = _ByteProgress(progress, sum(size or 0 for name, size in siblings if _wanted(name)))
        try:
            with _quiet_hub_logs():
                _precheck(repo, getattr(info, "sha", None) or revision, {name for name, _ in siblings})
                path = _snapshot(repo, revision, tqdm_class=tracker.bar_class(), max_workers=4)
        except MlxinferError:
            raise
        except Exception as e:  # noqa: BLE001 - _translate re-raises anything that is not a Hub/network/disk error
            raise _translate(e, repo, revision) from None
    finally:
        _Watch.since = None
    tracker.finish()
    return _check_dir(path, _label(repo, revision))


def _precheck(repo: str, revision: str | None, names: set[str]) -> None:
    """Fetch config.json and tokenizer_config.json first and refuse a repo that asks for custom code or has a broken
    config, before any weights are downloaded."""
    from huggingface_hub import hf_hub_download

    from ..engine.model_checks import check_config, read_config
    from ..engine.trust import check_no_remote_code

    folder = None
    for name in _PRECHECK:
        if name in names:
            folder = Path(hf_hub_download(
                repo, name, revision=revision, cache_dir=hub_cache_dir(), endpoint=hub_endpoint(), token=_token(),
                library_name="mlxinfer",
            )).parent
    if folder is not None:
        check_config(folder, read_config(folder))
        check_no_remote_code(folder)
