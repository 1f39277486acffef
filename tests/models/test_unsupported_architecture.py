"""A model of an architecture fleetllm does not run is refused at start: one line naming it and the supported
ones, exit status 2, no traceback."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fleetllm.cli import main


@pytest.fixture
def mamba_dir(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mamba", "architectures": ["MambaForCausalLM"],
                                                      "vocab_size": 64, "hidden_size": 32}))
    return tmp_path


def test_generate_refuses_an_unsupported_architecture(mamba_dir: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["generate", "--model", str(mamba_dir), "hi"]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert "error: cannot start: model_type 'mamba'" in line and "MambaForCausalLM" in line
    assert "qwen3_moe" in line and "gpt_oss" in line


def test_a_worker_process_exits_2_naming_the_architecture(mamba_dir: Path) -> None:
    cmd = [sys.executable, "-m", "fleetllm.cli", "worker", "--model", str(mamba_dir), "--host", "127.0.0.1",
           "--port", "1"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    errors = [ln for ln in done.stderr.splitlines() if "error" in ln.lower()]
    assert len(errors) == 1 and "cannot start: model_type 'mamba'" in errors[0] and "mixtral" in errors[0]
    assert "Traceback" not in done.stderr + done.stdout
