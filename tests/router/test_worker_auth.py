"""What the router presents upstream: the fleet's secret to fleetllm workers only, and a decode worker's URL
that a prefill worker accepts."""

from __future__ import annotations

import httpx
import pytest

from fleetllm.router.worker_auth import UNKNOWN, WorkerAuth, origin


def _sent(kind: str | None) -> str | None:
    seen = {}

    def handler(request: httpx.Request) -> httpx.Response:
        seen["auth"] = request.headers.get("authorization")
        return httpx.Response(200)

    kinds = {origin("http://w:1"): kind}
    with httpx.Client(transport=httpx.MockTransport(handler), auth=WorkerAuth("s3cret", lambda o: kinds.get(o, UNKNOWN))) as c:
        c.get("http://w:1/v1/models", headers={"authorization": "Bearer a-clients-key"})
    return seen["auth"]


@pytest.mark.parametrize("kind", ["vllm", "sglang", "tgi", "llamacpp", "openai", None, UNKNOWN])
def test_the_secret_never_reaches_another_engine_or_an_unproven_url(kind: str | None) -> None:
    assert _sent(kind) is None


def test_a_fleetllm_worker_gets_the_secret() -> None:
    assert _sent("fleetllm") == "Bearer s3cret"


@pytest.mark.parametrize("url", ["http://10.0.0.5:8001", "https://w.example:443/", "http://w"])
def test_a_decode_url_is_a_workers_base_url(url: str) -> None:
    from fleetllm.disagg.prefill_side import peer_url

    assert peer_url(url) == url.rstrip("/")


@pytest.mark.parametrize("url", ["file:///etc/passwd", "http://w:1/admin", "http://u:p@w:1", "http://w:1?x=1",
                                 "http://w:99999", "gopher://w:70", "", 7, None])
def test_any_other_decode_url_is_a_400(url: object) -> None:
    from fleetllm.disagg.prefill_side import peer_url
    from fleetllm.server.protocol import APIError

    with pytest.raises(APIError) as e:
        peer_url(url)
    assert e.value.status == 400 and e.value.param == "decode_url"
