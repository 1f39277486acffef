"""Scheduling with adapters: a step holds requests of at most ``max_loras`` adapters; a request whose adapter finds
no slot waits in its place, base-model requests pass it, and later requests of running adapters do not (no
starvation)."""

from __future__ import annotations

from fleetllm.engine.llm import LLM
from fleetllm.engine.sampling import SamplingParams

PROMPTS = [[1, 17, 230, 45, 99, 310, 7, 88], [1, 401, 12, 12, 87, 260, 3, 190]]

def test_a_step_holds_at_most_max_loras_adapters_and_every_request_finishes(tiny_lora) -> None:
    llm = LLM(str(tiny_lora.base_dir), quantization="none", enable_lora=True, max_loras=1, num_blocks=64)
    for name, path in tiny_lora.dirs.items():
        llm.load_lora(name, str(path))
    sched, seen = llm.engine.scheduler, []
    schedule = sched.schedule

    def watched(drafts=None):  # noqa: ANN001, ANN202 - the scheduler's own signature
        out = schedule(drafts)
        seen.append({s.seq.lora_name for s in out.scheduled} - {None})
        return out

    sched.schedule = watched
    names = ["qv4", "all8", None, "qv4", "mixed16", "all8", None]
    res = llm.generate([PROMPTS[1]] * len(names), SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True),
                       lora_name=names)
    assert all(len(r.outputs[0].token_ids) == 3 for r in res)
    assert max(len(s) for s in seen) == 1
    assert len(set().union(*seen)) == 3


def test_a_waiting_adapter_is_passed_by_base_requests_but_not_by_running_adapters_requests(tiny_lora) -> None:
    llm = LLM(str(tiny_lora.base_dir), quantization="none", enable_lora=True, max_loras=1, num_blocks=64)
    for name in ("qv4", "all8"):
        llm.load_lora(name, str(tiny_lora.dirs[name]))
    engine = llm.engine
    long, short = (SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (12, 2))
    engine.add_request("first", PROMPTS[1], long, lora_name="qv4")
    engine.step()  # qv4 holds the only slot
    for rid, lora in (("blocked", "all8"), ("base", None), ("again", "qv4")):
        engine.add_request(rid, PROMPTS[1], short, lora_name=lora)
    started = []
    while engine.has_unfinished():
        engine.step()
        started += [s.request_id for s in engine.seqs.values() if s.first_scheduled_time and s.request_id not in started]
    assert started.index("base") < started.index("blocked") < started.index("again")
