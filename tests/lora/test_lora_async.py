"""The async engine's adapter API: loads read off the engine thread, requests by adapter name, KV events naming
each stored block's adapter."""

from __future__ import annotations

import asyncio

import pytest

from fleetllm.engine.async_engine import AsyncEngine
from fleetllm.engine.engine import EngineConfig, LLMEngine
from fleetllm.engine.sampling import SamplingParams
from fleetllm.lora.errors import LoraError

PROMPT = [1, *range(300, 340)]  # two full blocks and some


def test_async_loads_requests_and_kv_events_carry_the_adapter(tiny_lora) -> None:
    engine = LLMEngine(EngineConfig(model=str(tiny_lora.base_dir), quantization="none", enable_lora=True,
                                    num_blocks=64))
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)

    async def main() -> tuple[list[int], list[tuple], int]:
        ae = AsyncEngine(engine)
        ae.start()
        try:
            await ae.load_lora("qv4", str(tiny_lora.dirs["qv4"]))
            q, _, _ = await ae.subscribe_kv_events()
            toks = [t async for out in ae.generate("r", PROMPT, params, lora_name="qv4") for t in out.new_token_ids]
            await ae.unload_lora("qv4")
            with pytest.raises(LoraError) as e:
                [o async for o in ae.generate("r", PROMPT, params, lora_name="qv4")]
            events = [q.get_nowait() for _ in range(q.qsize())]
            return toks, events, e.value.status
        finally:
            ae.shutdown()

    toks, events, status = asyncio.run(main())
    assert toks == tiny_lora.greedy("qv4", PROMPT, 3)
    assert [(kind, loras, medium) for kind, _, loras, medium in events] == [("stored", ["qv4"], None)] * 2 + [("removed", None, None)]
    assert status == 404
