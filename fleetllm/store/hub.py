"""Models from a Hugging Face hub (or any hub-compatible endpoint) through the official ``huggingface_hub`` client.

One ``model_info(revision, files_metadata=True)`` call resolves a branch or tag to its commit and lists the
files with their sizes and checksums (LFS files: SHA-256; files kept in git: the blob's SHA-1); downloads then
name the commit, so a branch that moves meanwhile changes nothing. A model without a configured token sends
none (``token=False``): a token a user keeps for other purposes never travels with another model's requests.
"""

from __future__ import annotations

from pathlib import Path

from fleetllm.store.checksum import Checksum
from fleetllm.store.errors import SourceUnreachable, StoreError
from fleetllm.store.remote import Listing, RemoteFile
from fleetllm.store.secret import Secret
from fleetllm.store.uri import ModelURI


class HubSource:
    """A hub repository; ``endpoint`` None means huggingface_hub's default ($HF_ENDPOINT or huggingface.co)."""

    def __init__(self, uri: ModelURI, endpoint: str | None, token: Secret | None) -> None:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()  # a worker's log is for events, not a bar per file
        self.uri, self.endpoint, self._token = uri, endpoint, token

    def _auth(self) -> str | bool:
        return self._token.reveal() if self._token else False

    def resolve(self, revision: str | None) -> Listing:
        from huggingface_hub import HfApi

        api = HfApi(endpoint=self.endpoint)
        try:
            info = api.model_info(self.uri.repo, revision=revision, files_metadata=True, token=self._auth())
        except Exception as e:  # noqa: BLE001 - sorted into what a cache can and cannot fix
            raise self._error(e) from None
        files = {}
        for s in info.siblings or []:
            if s.lfs is not None:
                checksum = Checksum("sha256", s.lfs.sha256)
                size = s.lfs.size
            else:
                checksum = Checksum("git-sha1", s.blob_id) if s.blob_id else None
                size = s.size or 0
            files[s.rfilename] = RemoteFile(s.rfilename, size, checksum)
        return Listing(info.sha, files)

    def download(self, commit: str, f: RemoteFile, staging: Path) -> tuple[Path, Checksum | None]:
        from huggingface_hub import hf_hub_download

        try:  # local_dir keeps partial downloads in staging/.cache: an interrupted pull resumes
            path = hf_hub_download(self.uri.repo, f.name, revision=commit, local_dir=staging,
                                   endpoint=self.endpoint, token=self._auth())
        except Exception as e:  # noqa: BLE001
            raise self._error(e) from None
        return Path(path), f.checksum

    def _error(self, e: Exception) -> Exception:
        """The client's exception as the store's: it names the model, never the token or request headers."""
        status = getattr(getattr(e, "response", None), "status_code", None)
        name = type(e).__name__
        if name == "GatedRepoError" or status in (401, 403):
            hint = "give its token (token_file / token_env)" if self._token is None else "its token is refused"
            return StoreError(f"model {self.uri}: the hub answered {status or 401}: the repository is gated or "
                              f"private and {hint}", status or 401)
        if name in ("RepositoryNotFoundError", "RevisionNotFoundError", "EntryNotFoundError",
                    "RemoteEntryNotFoundError") or status == 404:
            return StoreError(f"model {self.uri}: not found on the hub ({name})", 404)
        if status is not None and status < 500 and status != 429:
            return StoreError(f"model {self.uri}: the hub answered {status}", 502)
        return SourceUnreachable(f"hub {self.endpoint or 'default endpoint'} unreachable ({name})")
