"""Hugging Face Hub source: download only what an MLX model needs, and re-use the local cache when offline.

Everything goes through the real ``huggingface_hub`` client and its standard cache (``$HF_HOME/hub``), so models
downloaded here are shared with mlx-lm, transformers and ``hf download``. Only safetensors weights, JSON configs and
tokenizer files are fetched: pickle weights are never loaded and remote code (``*.py``) is never downloaded.
"""

from __future__ import annotations

import fnmatch
import threading
import time
from pathlib import Path
from typing import Callable

from ..errors import DownloadError, InvalidModel, MlxinferError
from .hub_net import (  # noqa: F401 - hub_cache_dir, hf_home, hub_offline, hub_timeout are part of this API
    HubStalled,
    _answered,
    _label,
    _quiet_hub_logs,
    _reason,
    _token,
    _translate,
    _Watch,
    hf_home,
    hub_cache_dir,
    hub_endpoint,
    hub_offline,
    hub_timeout,
    install_timeouts,
)

Progress = Callable[[str, int, int], None]

# What an MLX model directory needs; top-level files only (subfolders such as original/ hold other formats).
# Weights are model*.safetensors, the files mlx-lm loads: a top-level consolidated.safetensors is a duplicate.
ALLOW_PATTERNS = ["model*.safetensors", "*.json", "tokenizer.model", "*.tiktoken", "*.txt", "*.jinja"]
IGNORE_PATTERNS = ["*/*"]
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
_PRECHECK = ("config.json", "tokenizer_config.json")  # read before any weights are fetched


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


def download_model(repo: str, revision: str | None = None, *, progress: Progress | None = None,
                   force: bool = False) -> Path:
    """Download (or find in the cache) the MLX files of a Hub model repo; returns the snapshot directory.
    ``force``: download every file again, also those in the cache (one there is damaged).

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

    install_timeouts()
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
                path = _snapshot(repo, revision, tqdm_class=tracker.bar_class(), max_workers=4, force_download=force)
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
