"""Model references: what a store URI names."""

import pytest

from fleetllm.store.uri import ModelURI, is_remote


def test_hub_uri_with_revision():
    u = ModelURI.parse("hf://HuggingFaceTB/SmolLM2-135M-Instruct@v1.0")
    assert (u.scheme, u.repo, u.file, u.revision) == ("hf", "HuggingFaceTB/SmolLM2-135M-Instruct", None, "v1.0")
    assert str(u) == "hf://HuggingFaceTB/SmolLM2-135M-Instruct@v1.0"


def test_hub_uri_naming_one_gguf_of_many():
    u = ModelURI.parse("hf://org/name-GGUF/name.Q4_K_M.gguf@main")
    assert (u.repo, u.file, u.revision) == ("org/name-GGUF", "name.Q4_K_M.gguf", "main")


def test_s3_uri_bucket_and_prefix():
    u = ModelURI.parse("s3://models/team/smollm2/")
    assert (u.bucket, u.prefix, u.revision) == ("models", "team/smollm2", None)


def test_pinning_keeps_the_repo_and_file():
    u = ModelURI.parse("hf://org/name/x.gguf@main").at("a" * 40)
    assert str(u) == f"hf://org/name/x.gguf@{'a' * 40}" and u.key == "hf--org--name"


@pytest.mark.parametrize("ref", ["hf://only-org", "hf://a/b/c", "s3://", "ftp://x/y"])
def test_malformed_uris_are_refused(ref):
    with pytest.raises(ValueError):
        ModelURI.parse(ref)


def test_local_references_are_not_remote():
    assert not is_remote("smollm2-135m") and not is_remote("/models/x.gguf") and is_remote("s3://b/p")
