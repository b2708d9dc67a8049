"""The network side of the Hub source: the environment read per call, timeouts on every request huggingface_hub
makes, and one clear MlxinferError (with the hint that fits the cause) for each way a request can fail."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from pathlib import Path

from ..errors import DownloadError, MlxinferError, ModelNotFound

_TRUE = {"1", "ON", "YES", "TRUE"}
DEFAULT_TIMEOUT = 10.0  # seconds to connect, or to wait for the next bytes, per request
STALL_REQUESTS = 2      # silent for this many timeouts: give up rather than retry (10 s each: ~30 s at most)


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


def install_timeouts() -> None:
    """Make huggingface_hub's shared HTTP client (also used by transformers) apply the timeouts above."""
    global _installed
    if not _installed:
        from huggingface_hub import set_client_factory

        set_client_factory(_client_factory)
        _installed = True


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
        FileMetadataError,
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
    if isinstance(err, (json.JSONDecodeError, UnicodeDecodeError, FileMetadataError)) or isinstance(
            err.__cause__, FileMetadataError):  # e.g. a login page or a plain web server answering for the Hub
        return _not_understood(label)
    if isinstance(err, (LocalEntryNotFoundError, httpx2.HTTPError, ConnectionError, TimeoutError, HubStalled)):
        cause = err.__cause__ or err
        # A body cut short: the Hub answered, then the connection dropped ("cannot be reached" was wrong then).
        cut = isinstance(cause, (httpx2.RemoteProtocolError, httpx2.ReadError)) or "incomplete message body" in str(
            cause) or "without sending complete message body" in str(cause)
        why = "the connection dropped during the download" if cut else "the Hub cannot be reached"
        return DownloadError(
            f"download of {label} failed: {why} ({_reason(cause)})",
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
