"""``fleetllm doctor``: the install's kernels, versions, caches and tools; exit 1 only for a missing kernel."""

from __future__ import annotations

import json
import platform
from dataclasses import dataclass

import pytest

from fleetllm.cli import main
from fleetllm.kernels import health
from fleetllm.kernels.variants import KERNELS, expected_variant


def test_doctor_json_reports_each_kernel_versions_and_tools(capsys) -> None:
    rc = main(["doctor", "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert rc == 0 and doc["ok"] and doc["missing_kernels"] == []
    assert {k["kernel"]: k["variant"] for k in doc["kernels"] if k["expected"]} == {
        name: expected_variant(name) for name in KERNELS if expected_variant(name)}
    assert doc["python"]["version"] == platform.python_version() and doc["torch"]["threads"] >= 1
    assert doc["models"]["embedded"]["smollm2-135m"] and set(doc["tools"]) >= {"prometheus", "chromium", "redis"}


@dataclass
class Broken:
    variant: str | None = None
    error: str = "no C compiler on PATH"

    def get(self, wait: bool = False) -> None:
        return None


def test_doctor_exits_1_naming_a_missing_kernel(monkeypatch, capsys) -> None:
    if expected_variant("decode_stack") is None:
        pytest.skip("this CPU does not run decode_stack")
    libs = {name: Broken(expected_variant(name), None) for name in KERNELS} | {"decode_stack": Broken()}
    monkeypatch.setattr(health, "libraries", lambda: libs)
    assert main(["doctor"]) == 1
    out = capsys.readouterr().out
    assert out.startswith("fleetllm doctor: PROBLEMS: kernels missing: decode_stack")
    assert "decode_stack" in out and "no C compiler on PATH" in out and "decode ~2x slower" in out
