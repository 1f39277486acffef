"""The fused MoE kernel (``moe_experts.c``): one call per layer equals the block's op-by-op path over the same
Q8_0 weights (and an fp64 reference of its int16-activation contract) up to rounding, and so do 4-bit experts (a
GGUF's Q4_0, Q4_1, Q4_K) alone or beside Q8_0 ones; it picks the same experts, counts them, and reads no expert no
row chose."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from int16_activations import int16_rounded  # tests/ is on the path (pytest's prepend mode)
from kernel_checks import require_kernels

from fleetllm.kernels import moe_experts, q8
from fleetllm.kernels.moe_experts import FusedExperts
from fleetllm.models.config import ModelConfig
from fleetllm.models.moe import MoE

H, INTER, EXPERTS = 64, 32, 8


def q8_moe(top_k: int = 3, norm: bool = True, seed: int = 0, bits: tuple[int, int] = (8, 8)) -> MoE:
    """A seeded Qwen3-MoE block whose experts are Q8_0 (levels and fp16-rounded scales), as a GGUF loads them, or
    4-bit (``bits`` of gate_up and down: levels, scales and offsets), narrow steps on the kernels as a ``q4`` copy
    sets them."""
    cfg = ModelConfig(architecture="qwen3_moe", vocab_size=16, hidden_size=H, intermediate_size=64, num_layers=1,
                      num_heads=4, num_kv_heads=1, head_dim=16, num_experts=EXPERTS, num_experts_per_tok=top_k,
                      moe_intermediate_size=INTER, norm_topk_prob=norm)
    g = torch.Generator().manual_seed(seed)
    m = MoE(cfg)
    with torch.no_grad():
        m.router.weight.copy_(torch.randn(EXPERTS, H, generator=g) * 0.3)

    def levels(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        q = torch.randint(-127, 128, (EXPERTS, n, k), generator=g, dtype=torch.int8)
        return q, (torch.rand(EXPERTS, n, k // 32, generator=g) * 0.004 + 1e-4).half().float()

    def nibbles(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Levels, 6-bit factors per group, and a scale pair per super-block of 2 groups (Q4_K has 8) where there
        are 2, else per group."""
        q = torch.randint(0, 256, (EXPERTS, n, k // 2), generator=g, dtype=torch.uint8)
        f = torch.randint(0, 64, (EXPERTS, n, k // 16), generator=g, dtype=torch.uint8)
        supers = k // 64 if k % 64 == 0 else k // 32
        d = torch.rand(EXPERTS, n, 2 * supers, generator=g) * torch.tensor([0.001, 0.0075]).repeat(supers) + 1e-4
        return q, f, d

    shapes = ((2 * INTER, H), (H, INTER))
    m.set_quantised_experts(*((levels if b == 8 else nibbles)(*shape) for b, shape in zip(bits, shapes, strict=True)))
    m.q8_rows = 48
    return m


@pytest.fixture(autouse=True)
def kernels() -> None:
    require_kernels(moe_experts.LIBRARY, q8.LIBRARY)  # q8: the block's op-by-op path


def reference(m: MoE, x: torch.Tensor) -> torch.Tensor:
    """The block in fp64 over the Q8_0 weights, each token's choices in ascending expert order, each expert's
    inputs rounded to int16 as the kernel's contract says (its only departure from fp32 arithmetic)."""
    weights, idx = m.route(x)
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for e in sorted(idx[t].tolist()):
            gate_up, down = (w.dequantize().double() for w in m.q8[e])
            gate, up = (gate_up @ int16_rounded(x[t])).split(INTER)
            act = int16_rounded((F.silu(gate) * up).float())
            out[t] += weights[t, idx[t].tolist().index(e)].double() * (down @ act)
    return out


@pytest.mark.parametrize("rows", [1, 3, 8, 40])
@pytest.mark.parametrize("norm", [True, False], ids=["renormalised", "softmax-share"])
def test_the_kernel_equals_the_blocks_reference(rows: int, norm: bool) -> None:
    m = q8_moe(norm=norm)
    x = torch.randn(rows, H, generator=torch.Generator().manual_seed(rows))
    torch.testing.assert_close(FusedExperts.of(m)(x), m._experts(x), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(FusedExperts.of(m)(x).double(), reference(m, x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 8, 40])
@pytest.mark.parametrize("bits", [(4, 4), (4, 8)], ids=["4-bit", "4-bit-gate-up-q8-down"])
def test_4_bit_experts_equal_the_blocks_reference(rows: int, bits: tuple[int, int]) -> None:
    m = q8_moe(bits=bits)
    x = torch.randn(rows, H, generator=torch.Generator().manual_seed(rows))
    torch.testing.assert_close(FusedExperts.of(m)(x).double(), reference(m, x), rtol=1e-5, atol=1e-5)


def test_4_bit_experts_agree_on_every_path() -> None:
    """AVX2 gives VNNI's bits; the scalar path differs only by its router's and SiLU's rounding."""
    m = q8_moe(bits=(4, 4))
    x = torch.randn(11, H, generator=torch.Generator().manual_seed(6))
    fused = FusedExperts.of(m)
    assert torch.equal(fused(x, vector=2), fused(x))
    torch.testing.assert_close(fused(x, vector=0), fused(x), rtol=1e-5, atol=1e-5)


def test_the_scalar_path_equals_the_vector_path() -> None:
    m = q8_moe()
    x = torch.randn(20, H, generator=torch.Generator().manual_seed(1))
    fused = FusedExperts.of(m)
    torch.testing.assert_close(fused(x, vector=False), fused(x), rtol=1e-5, atol=1e-5)


def test_the_avx2_path_gives_the_vnni_paths_bits() -> None:
    m = q8_moe()
    x = torch.randn(9, H, generator=torch.Generator().manual_seed(5))
    fused = FusedExperts.of(m)
    assert torch.equal(fused(x, vector=2), fused(x))


def test_it_counts_the_rows_of_each_expert_as_the_router_chose() -> None:
    m = q8_moe(top_k=2)
    x = torch.randn(11, H, generator=torch.Generator().manual_seed(2))
    counts = torch.zeros(EXPERTS, dtype=torch.int64)
    FusedExperts.of(m)(x, counts)
    assert counts.tolist() == torch.bincount(m.route(x)[1].flatten(), minlength=EXPERTS).tolist()


def test_a_step_reads_only_the_chosen_experts() -> None:
    m = q8_moe()
    x = torch.randn(1, H, generator=torch.Generator().manual_seed(3))
    expected = FusedExperts.of(m)(x)
    chosen = set(m.route(x)[1][0].tolist())
    for e in set(range(EXPERTS)) - chosen:  # a read of any of these would spread NaN
        m.gate_up_d[e].fill_(float("nan"))
        m.down_d[e].fill_(float("nan"))
    torch.testing.assert_close(FusedExperts.of(m)(x), expected)


def test_narrow_steps_of_the_block_take_the_kernel_and_exact_mode_never(monkeypatch) -> None:
    m = q8_moe()
    x = torch.randn(4, H, generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(m(x), FusedExperts.of(m)(x), rtol=0, atol=0)
    assert m.expert_counts is not None and sum(m.expert_counts) == 4 * m.top_k

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("exact mode took the kernel")

    monkeypatch.setattr(FusedExperts, "__call__", refuse)
    m.q8_rows = 0  # exact mode (a loaded model): products over the dequantised weights, in PyTorch
    torch.testing.assert_close(m(x), m._experts(x), rtol=0, atol=0)


def test_layers_it_does_not_cover_keep_pytorch() -> None:
    m = q8_moe()
    m.router_kind = "topk_softmax"  # GPT-OSS's router
    assert FusedExperts.of(m) is None
