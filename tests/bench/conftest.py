"""Fixtures for bench tests: a fresh fake OpenAI-compatible server per test."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from fake_server import FakeServer, FakeState  # noqa: E402


@pytest.fixture
def fake() -> Iterator[FakeServer]:
    """A fake server with small token delays (fast, still a real streaming HTTP path)."""
    with FakeServer(FakeState(token_delay_s=0.001)) as server:
        yield server
