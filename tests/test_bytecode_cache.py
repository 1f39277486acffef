"""The test files' bytecode written once for every test process (tests/bytecode_cache.py)."""

from __future__ import annotations

from pathlib import Path

import bytecode_cache
import pytest
from _pytest.assertion.rewrite import PYC_TAIL, _read_pyc


def test_written_bytecode_is_pytests_rewritten_form_and_an_edit_makes_it_stale(tmp_path: Path) -> None:
    test_file, helper = tmp_path / "test_x.py", tmp_path / "helper_x.py"
    test_file.write_text("def test_a():\n    x = 2\n    assert x == 3\n")
    helper.write_text("VALUE = 7\n")
    assert bytecode_cache.stale([test_file, helper]) == [test_file, helper]
    assert bytecode_cache.write([test_file, helper]) == 2
    assert bytecode_cache.stale([test_file, helper]) == []

    code = _read_pyc(test_file, tmp_path / "__pycache__" / f"test_x{PYC_TAIL}")
    ns: dict = {}
    exec(code, ns)
    with pytest.raises(AssertionError, match="assert 2 == 3"):  # rewritten: the failing assert shows its operands
        ns["test_a"]()

    test_file.write_text("def test_a():\n    pass\n")
    assert bytecode_cache.stale([test_file, helper]) == [test_file]
