"""API keys: stored as hashes, refused when revoked, limited per key over a sliding window."""

from __future__ import annotations

import pytest

from fleetllm.router.keys import PREFIX, KeyLimiter, KeyStore, hash_key


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_a_created_key_authenticates_and_only_its_hash_is_stored(tmp_path):
    store = KeyStore(tmp_path / "keys.yaml")
    rec, key = store.create("team-a", models=["smollm2"], rpm_limit=10)
    assert key.startswith(PREFIX) and len(key) > 40
    text = (tmp_path / "keys.yaml").read_text()
    assert key not in text and hash_key(key) in text
    assert (tmp_path / "keys.yaml").stat().st_mode & 0o077 == 0
    assert store.authenticate(key).id == rec.id
    assert store.authenticate(key + "x") is None and store.authenticate(None) is None
    assert KeyStore(tmp_path / "keys.yaml").authenticate(key).rpm_limit == 10  # another reader of the file


def test_a_revoked_key_is_refused_at_once_by_every_reader_of_the_file(tmp_path):
    writer, router = KeyStore(tmp_path / "k.yaml"), None
    rec, key = writer.create("ci")
    router = KeyStore(tmp_path / "k.yaml")
    assert router.authenticate(key) is not None
    KeyStore(tmp_path / "k.yaml").revoke(rec.id)  # e.g. `fleetllm keys revoke` in another process
    assert router.authenticate(key) is None
    with pytest.raises(KeyError):
        writer.revoke(rec.id)


def test_models_restrict_what_a_key_may_call():
    from fleetllm.router.keys import KeyRecord

    assert KeyRecord("h", models=["a"]).allows("a") and not KeyRecord("h", models=["a"]).allows("b")
    assert KeyRecord("h").allows("anything")


def test_the_public_view_of_a_key_has_its_id_and_never_its_hash(tmp_path):
    rec, _ = KeyStore(tmp_path / "k.yaml").create("x", tpm_limit=5)
    pub = rec.public()
    assert pub["id"] == rec.id and "hash" not in pub and rec.hash not in str(pub)


def test_rpm_limit_refuses_the_request_past_the_limit_until_the_window_slides(tmp_path):
    rec, _ = KeyStore(tmp_path / "k.yaml").create(rpm_limit=3)
    clock = Clock()
    lim = KeyLimiter(window_s=10, clock=clock)
    for _ in range(3):
        assert lim.admit(rec) is None
        lim.done(rec, 0)
        clock.t += 1
    no = lim.admit(rec)
    assert no.status == 429 and "rpm_limit" in no.message and no.retry_after == pytest.approx(7.0)
    clock.t += 7.01
    assert lim.admit(rec) is None


def test_tpm_limit_counts_prompt_and_output_tokens_of_finished_requests(tmp_path):
    rec, _ = KeyStore(tmp_path / "k.yaml").create(tpm_limit=100)
    clock = Clock()
    lim = KeyLimiter(window_s=60, clock=clock)
    assert lim.admit(rec) is None
    lim.done(rec, 60)
    assert lim.admit(rec) is None
    lim.done(rec, 50)  # 110 tokens now: the next request waits for the window
    no = lim.admit(rec)
    assert no.status == 429 and "tpm_limit" in no.message and 0 < no.retry_after <= 60
    clock.t += 60.01
    assert lim.admit(rec) is None


def test_max_parallel_requests_frees_a_slot_when_a_request_ends(tmp_path):
    rec, _ = KeyStore(tmp_path / "k.yaml").create(max_parallel_requests=2)
    lim = KeyLimiter(clock=Clock())
    assert lim.admit(rec) is None and lim.admit(rec) is None
    assert lim.admit(rec).status == 429
    lim.done(rec, 0)
    assert lim.admit(rec) is None


# ---- the router's key gate (statuses and metering; the HTTP path is tested with the router) ----------

def gate(tmp_path, **limits):
    from prometheus_client import CollectorRegistry

    from fleetllm.router.auth import KeyGate

    store = KeyStore(tmp_path / "keys.yaml")
    rec, key = store.create("t", **limits)
    return KeyGate(store, KeyLimiter(clock=Clock()), CollectorRegistry()), rec, key


def test_the_gate_answers_401_403_and_429_with_retry_after(tmp_path):
    from fleetllm.server.protocol import APIError

    g, rec, key = gate(tmp_path, models=["a"], max_parallel_requests=1)
    for auth, model, status in [(None, "a", 401), ("Bearer nope", "a", 401), (f"Basic {key}", "a", 401),
                                (f"Bearer {key}", "b", 403)]:
        with pytest.raises(APIError) as e:
            g.admit(auth, model)
        assert e.value.status == status and key not in e.value.message
    assert g.admit(f"bearer {key}", "a").id == rec.id
    with pytest.raises(APIError) as e:
        g.admit(f"Bearer {key}", "a")
    assert e.value.status == 429 and e.value.headers["Retry-After"] == "1"


def test_the_gate_meters_usage_per_key_id_and_never_names_the_key(tmp_path):
    from prometheus_client import generate_latest

    g, rec, key = gate(tmp_path)
    r = g.admit(f"Bearer {key}", "m")
    g.done(r, 12, 30)
    assert (g.usage[rec.id].requests, g.usage[rec.id].prompt_tokens, g.usage[rec.id].completion_tokens) == (1, 12, 30)
    text = generate_latest(g.registry).decode()
    assert f'fleetllm_key_tokens_total{{key="{rec.id}",kind="completion"}} 30.0' in text
    assert key not in text and rec.hash not in text


def test_admin_routes_take_an_admin_key_and_refuse_other_keys_with_403(tmp_path):
    from fleetllm.router.config import RouterConfig
    from fleetllm.router.gateway import Router
    from fleetllm.server.protocol import APIError

    store = KeyStore(tmp_path / "keys.yaml")
    _, key = store.create("t")
    _, admin = store.create("ops", admin=True)
    r = Router(RouterConfig(keys_file=str(tmp_path / "keys.yaml")))
    r.require_admin(f"Bearer {admin}")
    with pytest.raises(APIError) as e:
        r.require_admin(f"Bearer {key}")
    assert e.value.status == 403
