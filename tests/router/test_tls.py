"""Router to worker over TLS: a worker process serving HTTPS with its certificate, a router that verifies it.

A CA and a certificate for 127.0.0.1 are made for the test (``cryptography``); the worker is a real
``fleetllm worker --simulate`` process started with ``--tls-certfile/--tls-keyfile``, the routers run in-process
with and without ``--worker-ca-file``.
"""

from __future__ import annotations

import datetime
import ipaddress
import ssl
import time
from pathlib import Path

import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from fleet_helpers import ADMIN, free_port, router, start_cli

pytestmark = pytest.mark.slow  # a worker process


def _cert(subject: str, key, issuer: x509.Name | None, issuer_key, ca: bool) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    b = (x509.CertificateBuilder().subject_name(name).issuer_name(issuer or name).public_key(key.public_key())
         .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
         .not_valid_after(now + datetime.timedelta(days=1))
         .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if ca:
        b = b.add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                          content_commitment=False, key_encipherment=False, data_encipherment=False,
                                          key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
    else:
        b = b.add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                            critical=False)
    return b.sign(issuer_key, hashes.SHA256())


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("pki")
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = _cert("fleetllm test CA", ca_key, None, ca_key, ca=True)
    cert = _cert("127.0.0.1", key, ca.subject, ca_key, ca=False)
    files = {"ca": d / "ca.pem", "cert": d / "worker.pem", "key": d / "worker.key"}
    files["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    files["cert"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    files["key"].write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
    return files


def test_a_router_given_the_ca_routes_to_an_https_worker_and_one_without_it_does_not(pki):
    port = free_port()
    url = f"https://127.0.0.1:{port}"
    worker = start_cli(["worker", "--simulate", "--port", str(port), "--log-level", "warning", "--sim-speed", "10",
                        "--tls-certfile", str(pki["cert"]), "--tls-keyfile", str(pki["key"])], [])
    ca = ssl.create_default_context(cafile=str(pki["ca"]))
    try:
        end = time.monotonic() + 60
        while True:  # the worker answers only over TLS, with the CA's certificate
            try:
                if httpx.get(url + "/ready", verify=ca, timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                assert time.monotonic() < end, worker.log()
                time.sleep(0.2)
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{port}/ready", timeout=5).raise_for_status()
        trusted = router([url], "round_robin", "--worker-ca-file", str(pki["ca"]))
        untrusted = router([url], "round_robin")
        try:
            body = {"model": "smollm2-135m", "prompt": "hello", "max_tokens": 4}
            r = httpx.post(trusted.url + "/v1/completions", json=body, timeout=30)
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 4
            state = httpx.get(untrusted.url + "/router/state", headers=ADMIN, timeout=5).json()
            assert not state["workers"][0]["healthy"]  # an unverifiable certificate is no worker
            assert httpx.post(untrusted.url + "/v1/completions", json=body, timeout=30).status_code >= 500
        finally:
            trusted.stop()
            untrusted.stop()
    finally:
        worker.stop()
