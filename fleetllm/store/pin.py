"""Pinning a fleet's models: each hf:// or s3:// source resolves once, when the fleet is deployed, to a commit.

Every copy of the model (the first ones and those the autoscaler adds hours later) is given
``hf://org/name@<commit>``, and the router the files of that commit's tokenizer, so a branch that moves upstream
changes nothing until the fleet is redeployed. A model's store settings (``token_env``, ``cache_dir``, ``hf_endpoint`` ...) are read from its
``engine:`` settings in the fleet YAML, the same keys as the worker's flags.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields, replace
from typing import TYPE_CHECKING, Any

from fleetllm.store.config import StoreConfig
from fleetllm.store.uri import is_remote

if TYPE_CHECKING:
    from fleetllm.fleet.config import AdapterSpec


def store_config(settings: Mapping[str, Any]) -> StoreConfig:
    """The store settings among a model's engine settings."""
    return StoreConfig(**{f.name: settings[f.name] for f in fields(StoreConfig) if f.name in settings})


def pin(source: str, settings: Mapping[str, Any]) -> tuple[str, str]:
    """``source`` pinned to the commit it resolves to now, and where the router reads its tokenizer: that
    commit's config and tokenizer files, fetched here into the model's cache (the router then needs neither the
    source nor the model's token). Local sources come back as they are."""
    if not is_remote(source):
        return source, source
    from fleetllm.store.store import ModelStore

    store = ModelStore(store_config(settings))
    pinned = str(store.pin(source))
    tokenizer = store.fetch(pinned, weights=False)
    tokenizer.release()
    return pinned, str(tokenizer.path)


def pin_adapter(adapter: AdapterSpec, settings: Mapping[str, Any]) -> AdapterSpec:
    """A LoRA adapter's source pinned to the commit it resolves to now, through its model's store settings and
    the adapter's own token (never the model's); a local source comes back as it is."""
    if not is_remote(adapter.source):
        return adapter
    from fleetllm.store.store import ModelStore

    cfg = replace(store_config(settings), token_env=adapter.token_env, token_file=adapter.token_file)
    return replace(adapter, source=str(ModelStore(cfg).pin(adapter.source)))


def token_envs(settings: Mapping[str, Any]) -> list[str]:
    """The environment variable holding this model's token, if it names one: hidden from other models' workers."""
    name = settings.get("token_env")
    return [name] if name else []
