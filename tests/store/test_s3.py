"""s3:// models through boto3, against the session's S3 API (moto[server], its own process on 127.0.0.1)."""

from __future__ import annotations

import pytest
from store_helpers import greedy, rot

from fleetllm.models.loader import load_model
from fleetllm.store.config import StoreConfig
from fleetllm.store.errors import StoreError
from fleetllm.store.store import ModelStore

BUCKET = "fleetllm-models"


@pytest.fixture(scope="module")
def bucket(s3_server) -> str:  # noqa: ANN001
    s3_server.client("s3").create_bucket(Bucket=BUCKET)
    return BUCKET


@pytest.fixture(scope="module")
def s3_model(s3_server, bucket) -> str:  # noqa: ANN001
    """The embedded model's GGUF (98 MB) under s3://fleetllm-models/smollm2/, uploaded with S3's SHA-256 checksum,
    beside a README the store must not fetch."""
    from fleetllm.models.source import resolve

    gguf = resolve("smollm2-135m")
    client = s3_server.client("s3")
    with open(gguf, "rb") as body:
        client.put_object(Bucket=BUCKET, Key=f"smollm2/{gguf.name}", Body=body, ChecksumAlgorithm="SHA256")
    client.put_object(Bucket=BUCKET, Key="smollm2/README.md", Body=b"# SmolLM2-135M-Instruct, Q4_1\n")
    return f"s3://{BUCKET}/smollm2"


@pytest.fixture
def s3_cfg(s3_server, tmp_path, monkeypatch) -> StoreConfig:  # noqa: ANN001
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    return StoreConfig(cache_dir=str(tmp_path / "cache"), s3_endpoint_url=s3_server.endpoint_url)


def test_greedy_output_from_s3_equals_the_local_model(s3_model, s3_cfg, local_greedy):
    loaded = load_model(s3_model, store=s3_cfg)  # its dequantised weights: the cache entry of the identical local file
    assert loaded.root == f"{s3_model}@{loaded.revision}" and loaded.phases["download"] > 0
    assert greedy(loaded) == local_greedy


def test_a_changed_object_is_a_new_revision_and_the_pinned_one_stays_cached(s3_server, bucket, s3_cfg):
    client = s3_server.client("s3")
    client.put_object(Bucket=BUCKET, Key="tiny/config.json", Body=b'{"a": 1}')
    client.put_object(Bucket=BUCKET, Key="tiny/model.safetensors", Body=b"x" * 64)
    store = ModelStore(s3_cfg)
    first = store.fetch(f"s3://{BUCKET}/tiny")
    client.put_object(Bucket=BUCKET, Key="tiny/model.safetensors", Body=b"y" * 64)
    moved = store.fetch(f"s3://{BUCKET}/tiny")
    assert moved.revision != first.revision
    assert (store.fetch(str(first.uri)).path / "model.safetensors").read_bytes() == b"x" * 64  # from the cache
    with pytest.raises(StoreError, match="changed since revision"):
        ModelStore(StoreConfig(cache_dir=s3_cfg.cache_dir + "-fresh", s3_endpoint_url=s3_cfg.s3_endpoint_url)
                   ).fetch(str(first.uri))


def test_an_interrupted_download_resumes_from_its_part_file(s3_server, bucket, s3_cfg):
    client = s3_server.client("s3")
    body = bytes(range(256)) * 64
    client.put_object(Bucket=BUCKET, Key="resume/model.safetensors", Body=body)
    client.put_object(Bucket=BUCKET, Key="resume/config.json", Body=b"{}")
    store = ModelStore(s3_cfg)
    commit = store.pin(f"s3://{BUCKET}/resume").revision
    staging = store.cache.revision("s3--fleetllm-models--resume", commit).staging
    staging.mkdir(parents=True)
    (staging / "model.safetensors.part").write_bytes(body[:5000])  # what a killed pull left
    fetched = store.fetch(f"s3://{BUCKET}/resume")
    assert (fetched.path / "model.safetensors").read_bytes() == body  # the rest appended, MD5 ETag checked


def test_verify_repair_fetches_a_rotten_file_again_from_the_bucket(s3_server, bucket, s3_cfg, capsys):
    from fleetllm.cli import main

    client = s3_server.client("s3")
    client.put_object(Bucket=BUCKET, Key="rot/config.json", Body=b'{"a": 1}')
    client.put_object(Bucket=BUCKET, Key="rot/model.safetensors", Body=bytes(range(256)))
    fetched = ModelStore(s3_cfg).fetch(f"s3://{BUCKET}/rot")
    rot(fetched.path / "model.safetensors")
    flags = ["--cache-dir", s3_cfg.cache_dir, "--s3-endpoint-url", s3_cfg.s3_endpoint_url]
    assert main(["models", "verify", f"s3://{BUCKET}/rot", "--repair", *flags]) == 0
    assert "model.safetensors: fetched again" in capsys.readouterr().out
    assert (fetched.path / "model.safetensors").read_bytes() == bytes(range(256))
    fetched.release()
