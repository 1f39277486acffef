"""The store's settings: one dataclass, each field a flag of ``fleetllm worker`` and ``fleetllm models``.

Stdlib only (the CLI and the router import it without torch). A token is never a setting: only the file or
the environment variable that holds it is, so a command line, a fleet YAML or a log never shows one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from fleetllm.cli_options import opt


@dataclass
class StoreConfig:
    """Where remote models are cached, how their sources are reached, and the model's own token."""

    cache_dir: str | None = opt(None, "node-local model cache (default: $FLEETLLM_CACHE_DIR/store, "
                                      "~/.cache/fleetllm/store)")
    cache_max_gb: float | None = opt(None, "size limit of the model cache: least recently used revisions "
                                           "not in use are evicted past it (default: no limit)")
    hf_endpoint: str | None = opt(None, "Hugging Face hub endpoint for hf:// models (default: $HF_ENDPOINT, "
                                        "else https://huggingface.co)")
    s3_endpoint_url: str | None = opt(None, "S3 endpoint for s3:// models (default: boto3's, e.g. "
                                            "$AWS_ENDPOINT_URL)")
    token_file: str | None = opt(None, "file holding this model's hub token (gated or private repos)")
    token_env: str | None = opt(None, "environment variable holding this model's hub token")
    download_workers: int = opt(8, "files downloaded in parallel")
    offline: bool = opt(False, "never contact the source: serve from the cache or fail")

    def root(self) -> Path:
        """The cache directory."""
        if self.cache_dir:
            return Path(self.cache_dir).expanduser()
        base = os.environ.get("FLEETLLM_CACHE_DIR") or Path.home() / ".cache" / "fleetllm"
        return Path(base) / "store"

    def endpoint(self) -> str | None:
        """The hub endpoint, or None for huggingface_hub's own default (which reads $HF_ENDPOINT)."""
        return (self.hf_endpoint or os.environ.get("HF_ENDPOINT") or "").rstrip("/") or None
