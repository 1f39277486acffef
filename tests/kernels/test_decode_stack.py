"""A ``q4`` model's pure decode steps in one C call equal its op-by-op steps up to float rounding."""

from __future__ import annotations

import pytest
import torch
from kernel_checks import require_kernels  # tests/ is on the path (pytest's prepend mode)

from fleetllm import LLM, SamplingParams
from fleetllm.kernels import attention, bf16, decode_stack, kv8, q4, q4_int
from fleetllm.kernels.decode_stack import DecodeStack
from fleetllm.models.llama import AttentionMetadata, PrefillChunk
from fleetllm.models.quant import STACK_ROWS, quantize_model

BLOCK = 16
# the bounds on the stack's difference from the op-by-op path, per kernel of wide steps (see relative())
SCALE = {"int16": 1, "bf16": 3}


@pytest.fixture(scope="module")
def q4_model(loaded_model):
    require_kernels(decode_stack.LIBRARY, q4.LIBRARY, q4_int.LIBRARY, attention.LIBRARY)
    model = quantize_model(loaded_model.model, "q4")
    assert model.decode_stack is not None
    return model


@pytest.fixture(params=["int16", "bf16"])
def wide(request) -> str:
    """Steps of ``BF16_ROWS`` rows or more through the bf16 kernel (where this CPU has one), or through the int16
    Q4 GEMM in the stack and fp32 op by op: the stack is held to the op-by-op path both ways."""
    if request.param == "bf16":
        require_kernels(bf16.LIBRARY)
    bf16.set_enabled(request.param == "bf16")
    yield request.param
    bf16.set_enabled(True)


def decode_step(model, lens: list[int], dtype: torch.dtype, seed: int = 0):
    """Inputs of one decode step: a row per sequence with ``lens[i]`` positions (its new token included),
    scattered blocks, and caches filled with noise for the context."""
    g = torch.Generator().manual_seed(seed)
    attn = model.layers[0].attn
    blocks = sum(-(-n // BLOCK) for n in lens) + 4
    order = torch.randperm(blocks, generator=g).tolist()
    tables, slots = torch.zeros(len(lens), -(-max(lens) // BLOCK), dtype=torch.int32), []
    for r, n in enumerate(lens):
        row = [order.pop() for _ in range(-(-n // BLOCK))]
        tables[r, : len(row)] = torch.tensor(row, dtype=torch.int32)
        slots.append(row[(n - 1) // BLOCK] * BLOCK + (n - 1) % BLOCK)
    caches = [tuple(kv8.convert(torch.randn(blocks * BLOCK, attn.hkv, attn.d, generator=g), dtype) for _ in range(2))
              for _ in model.layers]
    meta = AttentionMetadata(slot_mapping=torch.tensor(slots), decode_idx=torch.arange(len(lens)),
                             decode_tables=tables, decode_lens=torch.tensor(lens, dtype=torch.int32), block_size=BLOCK)
    ids = torch.randint(0, 49152, (len(lens),), generator=g)
    return ids, torch.tensor(lens) - 1, meta, caches


def verify_step(model, lens: list[int], chunk: int, dtype: torch.dtype):
    """A step whose last sequence verifies ``chunk - 1`` drafts: its last ``chunk`` positions are queries over
    its cached context; the other sequences decode one token each."""
    ids, positions, meta, caches = decode_step(model, lens, dtype)
    table, n_ctx = meta.decode_tables[-1], lens[-1]
    slot = [int(table[p // BLOCK]) * BLOCK + p % BLOCK for p in range(n_ctx)]
    d = len(lens) - 1
    meta.slot_mapping = torch.tensor(meta.slot_mapping[:d].tolist() + slot[n_ctx - chunk:])
    meta.decode_idx, meta.decode_tables, meta.decode_lens = (meta.decode_idx[:d], meta.decode_tables[:d],
                                                            meta.decode_lens[:d])
    meta.prefills = [PrefillChunk(d, d + chunk, torch.tensor(slot), fresh=False, block_table=table[: -(-n_ctx // BLOCK)],
                                  context_len=n_ctx)]
    positions = torch.tensor(positions[:d].tolist() + list(range(n_ctx - chunk, n_ctx)))
    ids = torch.cat([ids[:d], torch.randint(0, 49152, (chunk,), generator=torch.Generator().manual_seed(chunk))])
    return ids, positions, meta, caches


@pytest.mark.parametrize(("chunk", "last"), [(2, 70), (3, 70), (5, 70), (8, 70), (30, 30), (17, 17)])
def test_stack_takes_short_chunks(q4_model, monkeypatch, wide: str, chunk: int, last: int) -> None:
    """Verification (a few queries over cached context) and short prompts (``chunk == last``: nothing cached)."""
    ids, positions, meta, caches = verify_step(q4_model, [7, 40, last], chunk, torch.float32)
    meta.prefills[0].fresh = chunk == last
    calls = spy(monkeypatch)
    fused, fused_caches = forward(q4_model, ids, positions, meta, caches, stack=True)
    eager, eager_caches = forward(q4_model, ids, positions, meta, caches, stack=False)
    assert calls == [1]
    # over noise caches a verification's queries amplify the rounding apart: by hand over 6-12 seeds up to 1.6%
    # with int16 activations, 5.9% with bf16 ones (a neighbouring bf16 value is 2^-8 away, an int16 one 2^-15)
    bound = SCALE[wide] * 5e-2
    assert relative(fused, eager) < bound
    for (fk, fv), (ek, ev) in zip(fused_caches, eager_caches, strict=True):
        assert relative(fk, ek) < bound and relative(fv, ev) < bound


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """RMS of ``a - b`` relative to ``b``'s: the stack and the op-by-op path round RMSNorm's output differently,
    so an activation can round to a neighbouring int16 level (or bf16 value) and later layers carry the
    difference on (a wrong row, head or slot is off by the values' own size)."""
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def spy(monkeypatch) -> list[int]:
    """Counts the stack's runs."""
    calls: list[int] = []
    run = DecodeStack.run
    monkeypatch.setattr(DecodeStack, "run", lambda self, *a: calls.append(1) or run(self, *a))
    return calls


def forward(model, ids, positions, meta, caches, stack: bool):
    caches = [(k.clone(), v.clone()) for k, v in caches]
    decode_stack.set_enabled(stack)
    try:
        return model(ids, positions, meta, caches), caches
    finally:
        decode_stack.set_enabled(True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("lens", [[1], [5, 17, 33, 64, 100], [3] * 9])
def test_stack_equals_the_op_by_op_step(q4_model, monkeypatch, wide: str, dtype: torch.dtype, lens: list[int]) -> None:
    ids, positions, meta, caches = decode_step(q4_model, lens, dtype)
    calls = spy(monkeypatch)
    fused, fused_caches = forward(q4_model, ids, positions, meta, caches, stack=True)
    eager, eager_caches = forward(q4_model, ids, positions, meta, caches, stack=False)
    assert calls == [1]
    # every layer's cache is held to a relative RMS error (see relative(); a 16-bit cache stores neighbouring
    # values, which 30 layers carry on into the output), and the first layer's, which sees the same input, to the
    # rounding of its activations
    assert relative(fused, eager) < SCALE[wide] * (1e-2 if dtype == torch.float32 else 5e-2)
    for i, (fc, ec) in enumerate(zip(fused_caches, eager_caches, strict=True)):
        for f, e in zip(fc, ec, strict=True):
            assert relative(f[meta.slot_mapping], e[meta.slot_mapping]) < SCALE[wide] * 2e-2, f"layer {i}"
            f, e = f[meta.slot_mapping].float(), e[meta.slot_mapping].float()
            if i == 0:
                torch.testing.assert_close(f, e, rtol=1e-2, atol=1e-2)
    slot = meta.slot_mapping
    assert not torch.equal(fused_caches[0][0][slot], caches[0][0][slot]), "the new tokens' keys were written"


def test_steps_it_does_not_cover_go_op_by_op(q4_model, monkeypatch) -> None:
    calls = spy(monkeypatch)
    ids, positions, meta, caches = decode_step(q4_model, [4] * STACK_ROWS, torch.float32)
    forward(q4_model, ids, positions, meta, caches, stack=True)  # wide: op by op
    ids, positions, meta, caches = decode_step(q4_model, [4, 9], torch.float32)
    q4_model(ids, positions, meta, caches, aux_layers=(1,))  # an EAGLE drafter's features
    forward(q4_model, *decode_step(q4_model, [4, 9], torch.float32), stack=False)  # switched off
    ids, positions, meta, caches = verify_step(q4_model, [7, 400], 41, torch.float32)
    assert 41 * 400 > decode_stack.MAX_CHUNK_KEYS
    forward(q4_model, ids, positions, meta, caches, stack=True)  # a chunk with too many keys for the kernel
    meta.prefills[0].block_table = None
    forward(q4_model, ids, positions, meta, caches, stack=True)  # a chunk without its block table
    assert calls == []
    forward(q4_model, *decode_step(q4_model, [4, 9], torch.float32), stack=True)
    assert calls == [1]


@pytest.mark.parametrize(("dtype", "n"), [(torch.float32, decode_stack.KERNEL_MAX_CHUNK),
                                         (torch.int8, decode_stack.KERNEL_MAX_CHUNK_8BIT)])
def test_verification_chunks_take_the_stack_past_its_key_bound(q4_model, monkeypatch, dtype, n) -> None:
    """A chunk of up to ``KERNEL_MAX_CHUNK`` queries over cached context (``KERNEL_MAX_CHUNK_8BIT`` over an 8-bit
    cache) reads the paged kernel at any context (off the stack too), so the stack takes it; a longer one over as
    many keys goes op by op."""
    monkeypatch.setattr(decode_stack, "MAX_CHUNK_KEYS", 64)
    calls = spy(monkeypatch)
    forward(q4_model, *verify_step(q4_model, [7, 70], n + 1, dtype), stack=True)
    assert calls == []
    forward(q4_model, *verify_step(q4_model, [7, 70], n, dtype), stack=True)
    assert calls == [1]


def test_models_it_does_not_cover_get_no_stack(loaded_model) -> None:
    assert DecodeStack.build(loaded_model.model, STACK_ROWS) is None  # fp32 linears
    assert getattr(quantize_model(loaded_model.model, "int4"), "decode_stack", None) is None


def test_greedy_tokens_equal_the_op_by_op_path(loaded_model, q4_model) -> None:
    prompts = [loaded_model.tokenizer.encode(p) for p in ("def fibonacci(n):", "The capital of France is",
                                                            "Once upon a time, in a land far away,")]
    # fp32 KV: the two paths' K and V differ by float rounding, which an 8-bit cache can turn into a whole level
    # (one of these prompts then leaves the other path's greedy tokens at its 4th)
    llm = LLM(loaded=loaded_model, quantization="q4", num_blocks=64, kv_cache_dtype="fp32")
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    runs = {}
    for stack in (True, False):
        decode_stack.set_enabled(stack)
        try:
            runs[stack] = [[r.outputs[0].token_ids for r in llm.generate(prompts, params)],
                           llm.generate(prompts[0], params)[0].outputs[0].token_ids]
        finally:
            decode_stack.set_enabled(True)
    assert runs[True] == runs[False]


def test_a_step_paused_after_every_layer_and_resumed_computes_what_one_call_does(q4_model) -> None:
    from fleetllm.engine.step_pause import StepPause

    ids, positions, meta, caches = decode_step(q4_model, [5, 17, 33, 64], torch.int8)
    whole, whole_caches = forward(q4_model, ids, positions, meta, caches, stack=True)
    pause = StepPause()
    pause.on_pause = lambda: setattr(pause.flag, "value", 1)  # each pause asks for the next: one after every layer
    pause.arm(1.5)
    pause.flag.value = 1
    meta.pause = pause
    paused, paused_caches = forward(q4_model, ids, positions, meta, caches, stack=True)
    assert pause.pauses == len(q4_model.layers) - 1
    assert torch.equal(paused, whole)
    for (pk, pv), (wk, wv) in zip(paused_caches, whole_caches, strict=True):
        assert torch.equal(pk, wk) and torch.equal(pv, wv)
