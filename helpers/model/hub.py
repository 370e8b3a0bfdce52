"""Files from the Hugging Face Hub, cached, failing fast offline: the course must run without a network."""

from __future__ import annotations

import os
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path


class WeightsUnavailable(RuntimeError):
    """Pretrained weights could not be downloaded (offline, or the Hub unreachable) and are not cached."""


def hub_reachable(url: str, timeout: float) -> bool:
    """Whether the Hub answers at all (any HTTP status) within `timeout`: a quick probe before a long download."""
    try:
        urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=timeout).close()
    except urllib.error.HTTPError:
        return True  # the server answered (an error status is the Hub's to explain)
    except (urllib.error.URLError, OSError):
        return False
    return True


def download_files(repo_id: str, names: Sequence[str], cache_dir: str | os.PathLike | None = None,
                   endpoint: str | None = None, timeout: float = 5.0) -> Path:
    """The local folder holding `names` (e.g. config.json, model.safetensors) of a Hub repository, cached.

    Offline it fails within `timeout` seconds (the Hub client would otherwise retry for about half a minute),
    unless the files are already cached; `HF_HUB_OFFLINE=1` skips the network altogether.
    """
    from huggingface_hub import constants, hf_hub_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    endpoint = endpoint or constants.ENDPOINT
    offline = constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "").lower() in {"1", "true", "yes", "on"}
    online = not offline and hub_reachable(f"{endpoint}/api/models/{repo_id}", timeout)
    try:
        files = [hf_hub_download(repo_id, name, cache_dir=cache_dir, endpoint=endpoint, etag_timeout=timeout,
                                 local_files_only=not online) for name in names]
    except LocalEntryNotFoundError as err:
        why = "HF_HUB_OFFLINE is set" if offline else f"{endpoint} is unreachable"
        raise WeightsUnavailable(f"{repo_id} is not cached and {why}; connect once (or run "
                                 f"`hf download {repo_id}`) to cache it") from err
    return Path(files[-1]).parent
