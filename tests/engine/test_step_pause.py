"""A running step paused between layers for an urgent arrival (``fleetllm/engine/step_pause.py``): who may pause
which step, and, on the real model's C decode stack, that a paused step resumed computes what it would have."""

from __future__ import annotations

import pytest

from fleetllm.engine.step_pause import StepPause, step_guard


@pytest.mark.parametrize(("rows", "guard"), [([(1, False), (2, False)], 1.5), ([(1, True), (0, False)], 0.5),
                                             ([(0, True), (1, False)], 0.0), ([], None)])
def test_a_steps_guard_is_its_most_urgent_row_a_first_token_half_a_level_more_urgent(rows, guard):
    assert step_guard(rows) == guard


@pytest.mark.parametrize(("guard", "priority", "pauses"), [(1.5, 0, True), (1.5, -3, True), (0.5, 0, True),
                                                           (0.0, 0, False), (1.5, 1, False), (None, -1, False)])
def test_only_an_arrival_of_priority_at_most_0_more_urgent_than_the_guard_pauses_a_step(guard, priority, pauses):
    pause = StepPause()
    pause.on_pause = lambda: None
    pause.arm(guard)
    assert pause.ask(priority) is pauses and pause.flag.value == int(pauses)


def test_no_step_is_pausable_without_someone_to_run_the_urgent_work():
    pause = StepPause()
    pause.arm(1.5)
    assert not pause.ask(0) and pause.address() is None


def test_the_urgent_step_itself_runs_through():
    pause = StepPause()
    seen: list[int | None] = []
    pause.on_pause = lambda: seen.append(pause.address())
    pause.arm(1.5)
    assert pause.address() is not None
    pause.pause()
    assert seen == [None] and pause.flag.value == 0 and pause.pauses == 1


@pytest.fixture(scope="module")
def q4_engine(loaded_model):
    from kernel_checks import require_kernels  # tests/ is on the path

    from fleetllm.engine.engine import EngineConfig, LLMEngine
    from fleetllm.kernels import attention, decode_stack, q4, q4_int

    require_kernels(decode_stack.LIBRARY, q4.LIBRARY, q4_int.LIBRARY, attention.LIBRARY)
    cfg = EngineConfig(quantization="q4", scheduling_policy="priority", enable_prefix_caching=False, num_blocks=64,
                       max_num_seqs=4, speculative=None)
    return LLMEngine(cfg, loaded=loaded_model)


def serve(engine, tag: str, paused: bool) -> tuple[dict[str, list[int]], list[str]]:
    """Three bulk requests (priority 1) decoding; an urgent one (priority 0) arrives during their third step
    (``paused``: the step pauses after its first layer and computes the urgent prompt) or right after it. Returns
    each request's tokens and the order of the outputs (ids without ``tag``)."""
    from fleetllm.engine.params import SamplingParams

    tokens: dict[str, list[int]] = {}
    order: list[str] = []

    def note(outs) -> None:
        for o in outs:
            name = o.request_id.removeprefix(tag)
            order.append(name)
            tokens.setdefault(name, []).extend(o.new_token_ids)

    def params(priority: int) -> SamplingParams:
        return SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, priority=priority)

    for i, n in enumerate((20, 35, 50)):
        engine.add_request(f"{tag}bulk-{i}", [100 + 7 * i + j for j in range(n)], params(1))
    note(engine.step())
    note(engine.step())

    def arrive() -> None:
        engine.add_request(f"{tag}urgent", list(range(300, 340)), params(0))
        note(engine.urgent_step())

    if paused:
        engine.step_pause.on_pause = arrive
        engine.step_pause.flag.value = 1  # as the server's thread sets it when the request arrives
    try:
        note(engine.step())
    finally:
        engine.step_pause.on_pause = None
    if not paused:
        engine.add_request(f"{tag}urgent", list(range(300, 340)), params(0))
    while engine.has_unfinished():
        note(engine.step())
    return tokens, order


def test_an_urgent_prompt_computed_in_a_paused_step_changes_no_token_and_comes_out_first(q4_engine):
    paused, paused_order = serve(q4_engine, "p-", paused=True)
    after, after_order = serve(q4_engine, "a-", paused=False)
    assert q4_engine.step_pause.pauses == 1
    assert paused == after and all(len(t) == 5 for t in paused.values())
    third_step = paused_order[6:10]  # the outputs of the two steps before it, three each, then the paused step's
    assert third_step[0] == "urgent" and sorted(third_step[1:]) == ["bulk-0", "bulk-1", "bulk-2"]
    assert after_order[6:9] == sorted(after_order[6:9]) and after_order[9] == "urgent"


def test_a_request_arriving_at_the_async_engine_pauses_the_bulk_step_and_streams_its_first_token_before_it_ends(
        q4_engine):
    """As in a worker, whose engine always has the P/D connector attached (its steps without per-layer work still
    run on the C stack, and pause)."""
    import asyncio

    from fleetllm.disagg.connector import pd_connector
    from fleetllm.engine.async_engine import AsyncEngine
    from fleetllm.engine.params import SamplingParams

    pd_connector(q4_engine)

    bulk = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True, priority=1)
    urgent = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, priority=0)
    before = q4_engine.step_pause.pauses

    async def main() -> tuple[int, int, int]:
        ae = AsyncEngine(q4_engine)
        ae.start()
        try:
            streams = [ae.generate(f"bulk-{i}", [100 + i, *range(200, 230)], bulk) for i in range(3)]
            for s in streams:  # every bulk request is decoding
                await s.__anext__()
            first = await ae.generate("urgent", list(range(300, 340)), urgent).__anext__()
            decoding = sum(rid.startswith("bulk") for rid in list(q4_engine.seqs))
            tokens = sum([len(o.new_token_ids) for s in streams async for o in s])
            return len(first.new_token_ids), decoding, tokens
        finally:
            ae.shutdown()
            q4_engine.step_pause.on_pause = None

    first, decoding, tokens = asyncio.run(main())
    assert first == 1 and q4_engine.step_pause.pauses > before
    assert decoding == 3 and tokens == 3 * 47  # the bulk requests ran on, to their end
