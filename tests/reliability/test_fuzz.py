"""The published OpenAPI schema, fuzzed with schemathesis (bounded) against a simulated worker and a router
over it: no input gives a 5xx, and every rejection is an OpenAI-style error."""

from __future__ import annotations

import pytest

# schemathesis and hypothesis (1.5 s of imports) are imported by the test, not at collection: every test process
# collects this module, one runs it.
EXAMPLES = 5  # per operation and mode: about 15 s for both servers


def _check_examples(strategy, base_url: str, failures: list[str]) -> None:
    from hypothesis import HealthCheck, given, settings

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(case=strategy)
    def check(case) -> None:
        # a deadline bounds what a valid request may cost (16 choices of thousands of tokens)
        r = case.call(base_url=base_url, timeout=30, headers={"x-request-timeout": "0.1"})
        if r.status_code >= 500:
            failures.append(f"{case.operation.path}: {r.status_code} {r.text[:200]} for {case.body!r:.300}")
        elif r.status_code >= 400:
            err = r.json().get("error")
            assert isinstance(err, dict) and "message" in err and "type" in err, r.text

    check()


def _fuzz(base_url: str) -> None:
    import schemathesis
    from schemathesis.generation.modes import GenerationMode

    schema = schemathesis.openapi.from_url(base_url + "/openapi.json")
    failures = []
    for result in schema.get_all_operations():
        op = result.ok()
        if op.method.upper() != "POST":
            continue
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            _check_examples(op.as_strategy(mode), base_url, failures)
    assert not failures, "\n".join(failures[:10])


@pytest.mark.parametrize("server", ["sim", "sim_router"])
def test_fuzzed_requests_never_get_a_5xx(server: str, request) -> None:
    _fuzz(request.getfixturevalue(server).url)
