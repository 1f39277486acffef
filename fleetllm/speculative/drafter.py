"""The drafter seam: one small protocol, implementations registered by name.

A drafter proposes up to ``k`` tokens that the target is likely to produce next. Every drafter here is
deterministic (its proposal is a point mass), which is what :mod:`fleetllm.speculative.verify` assumes.
Drafters that read the target's hidden states say which layers (``aux_layers``) and get them through
``observe`` after every forward pass, for the rows that were accepted.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from fleetllm.engine.sequence import Sequence


class Drafter(Protocol):
    aux_layers: tuple[int, ...] | None  # target layers whose outputs ``observe`` receives (None: none)
    one_pass: bool  # drafts all k tokens in one forward (cost independent of k)

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        """Up to ``ks[i]`` draft tokens to follow ``seqs[i].all_token_ids`` (may be fewer, or none)."""
        ...

    def observe(self, seq: Sequence, start: int, features: torch.Tensor) -> None:
        """Target features of positions ``start .. start+len(features)-1`` of ``seq`` (now computed)."""
        ...

    def forget(self, seq: Sequence) -> None:
        """``seq`` finished or was preempted: drop what is kept for it."""
        ...


_REGISTRY: dict[str, Callable[..., Drafter]] = {}


def register(name: str) -> Callable[[Callable[..., Drafter]], Callable[..., Drafter]]:
    def deco(factory: Callable[..., Drafter]) -> Callable[..., Drafter]:
        _REGISTRY[name] = factory
        return factory

    return deco


def create_drafter(name: str, **kwargs: Any) -> Drafter:
    """Build the drafter registered as ``name`` (importing the built-in ones on first use)."""
    from fleetllm.speculative import eagle, ngram, suffix  # noqa: F401  (they register themselves)

    if name not in _REGISTRY:
        raise ValueError(f"unknown speculative method {name!r} (choices: {sorted(_REGISTRY)})")
    return _REGISTRY[name](**kwargs)


class TokenOnlyDrafter:
    """Base for drafters that read only token ids."""

    aux_layers: tuple[int, ...] | None = None
    one_pass = True

    def observe(self, seq: Sequence, start: int, features: torch.Tensor) -> None:
        pass

    def forget(self, seq: Sequence) -> None:
        pass
