"""Which instruction-set build of a kernel a CPU runs, the wheel's prebuilt objects found without a compiler, and
every build this CPU runs computing the same bits."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from kernel_checks import require_kernels  # tests/ is on the path (pytest's prepend mode)
from test_quant_gemv import q8_0_weight  # this folder is on the path too

from fleetllm.kernels import build, q8
from fleetllm.kernels.variants import (
    KERNELS,
    PREBUILT_DIR,
    VARIANTS,
    compile_command,
    expected_variant,
    library_name,
    source_digest,
    supported_variants,
    variants_for_machine,
    wheel_builds,
)

AVX2 = frozenset({"avx2", "fma", "f16c"})
SAPPHIRE_RAPIDS = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16"}


def test_each_cpu_gets_the_best_build_it_runs() -> None:
    assert supported_variants("q4_int_gemm", SAPPHIRE_RAPIDS)[0] == "avx512"
    assert supported_variants("q4_int_gemm", AVX2 | {"avx512f"}) == ("avx2", "portable")  # no VNNI/BF16
    assert supported_variants("q4_int_gemm", frozenset()) == ("portable",)
    assert supported_variants("decode_stack", SAPPHIRE_RAPIDS) == ("avx2", "portable")  # it has no AVX-512 path


def test_a_kernel_is_expected_only_where_the_cpu_has_its_instruction_set() -> None:
    assert expected_variant("decode_stack", frozenset()) is None  # no AVX2: the PyTorch path is the right one
    assert expected_variant("paged_attention", frozenset()) == "portable"  # it has a scalar path
    assert expected_variant("bf16_gemm", AVX2) is None and expected_variant("bf16_gemm", SAPPHIRE_RAPIDS) == "avx512"


def test_every_source_has_its_variants_declared() -> None:
    sources = {p.stem for p in Path(q8.__file__).parent.glob("*.c")}
    assert sources == set(KERNELS)
    assert all(set(k.variants) <= set(VARIANTS) and k.variants[-1] == "portable" for k in KERNELS.values())


def test_a_wheel_holds_every_build_of_its_architecture_or_only_what_this_cpu_loads() -> None:
    everything = wheel_builds()
    assert set(everything) == {(k, v) for k in KERNELS for v in KERNELS[k].variants if v in variants_for_machine()}
    native = wheel_builds("native")
    assert {k for k, _ in native} == set(KERNELS) and set(native) <= set(everything)
    assert all(v == supported_variants(k)[0] for k, v in native)
    with pytest.raises(ValueError, match="FLEETLLM_WHEEL_VARIANTS='avx9'"):
        wheel_builds("avx9")


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    """q8_gemv.c and the headers copied into a package folder of its own."""
    for path in [q8.LIBRARY.source, *q8.LIBRARY.source.parent.glob("*.h")]:
        shutil.copy(path, tmp_path)
    return tmp_path / "q8_gemv.c"


def prebuild(source: Path, variant: str) -> Path:
    """What setup.py does for one object of the wheel."""
    out = source.parent / PREBUILT_DIR / library_name(source.stem, variant, source_digest(source))
    out.parent.mkdir(exist_ok=True)
    subprocess.run(compile_command("cc", source, variant, out), check=True)
    return out


def test_the_wheels_object_loads_without_a_compiler(checkout: Path, monkeypatch) -> None:
    variant = supported_variants("q8_gemv")[0]
    path = prebuild(checkout, variant)
    monkeypatch.setattr(build, "compiler", lambda: None)
    assert build.locate(checkout) == (path, variant)
    q8._declare(ctypes.CDLL(str(path)))


def test_an_object_built_from_an_older_source_is_not_loaded(checkout: Path, monkeypatch) -> None:
    prebuild(checkout, "portable")
    checkout.write_text(checkout.read_text() + "\n/* edited */\n")
    monkeypatch.setattr(build, "compiler", lambda: None)
    with pytest.raises(RuntimeError, match="no C compiler"):
        build.locate(checkout)


def q8_gemv(lib: ctypes.CDLL, x: torch.Tensor, w: q8.Q8Weight) -> torch.Tensor:
    """``x @ W^T`` through one build's ``q8_gemv``, its vector path where the CPU has one."""
    (n, k), rows = w.shape, x.shape[0]
    out = torch.empty(rows, n)
    assert lib.q8_gemv(x.data_ptr(), k, w.q.data_ptr(), w.d.data_ptr(), out.data_ptr(), n, rows, n, k,
                       torch.get_num_threads(), 1) == 0
    return out


def test_every_build_this_cpu_runs_computes_the_same_bits() -> None:
    require_kernels(q8.LIBRARY)
    if len(supported_variants("q8_gemv")) < 2:
        pytest.skip("this CPU runs one build only")
    x, w = torch.randn(30, 256), q8.recover_q8_0(q8_0_weight(40, 256))
    outputs = {}
    for variant in supported_variants("q8_gemv"):
        lib = ctypes.CDLL(str(build.build(q8.LIBRARY.source, variant=variant)))
        q8._declare(lib)
        outputs[variant] = q8_gemv(lib, x, w)
    assert all(torch.equal(y, outputs["portable"]) for y in outputs.values())
