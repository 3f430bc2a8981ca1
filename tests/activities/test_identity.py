"""The cluster CA and an attempt's identity, with real keys and certificates (`cryptography`): a certificate names
the attempt's SPIFFE ID, is signed by the CA and lives for its TTL; a request for another identity, or one not
signed by its own key, is refused; the CA is made once, its key readable by its owner only."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec

from activities.identity import (
    SKEW,
    AttemptIdentity,
    ClusterCA,
    IdentityRefused,
    identity_of,
    spiffe_id,
    validity,
)

NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
ID = "spiffe://astraeus/ns/team-a/run/llm/worker/w-0/attempt/3"


def test_the_identity_names_the_workspace_run_worker_and_attempt() -> None:
    assert spiffe_id("team-a", "llm", "w-0", 3) == ID


def test_a_certificate_names_the_attempt_and_is_signed_by_the_cluster_ca(tmp_path: Path) -> None:
    ca = ClusterCA(tmp_path / "ca")
    attempt = AttemptIdentity(tmp_path / "identity" / "team-a.llm.w-0.3")
    cert_pem = ca.sign(attempt.request(ID), ID, timedelta(hours=1), NOW)
    attempt.keep(cert_pem, ca.certificate_pem())

    cert = x509.load_pem_x509_certificate((attempt.directory / "cert.pem").read_bytes())
    issuer = x509.load_pem_x509_certificate((attempt.directory / "bundle.pem").read_bytes())
    cert.verify_directly_issued_by(issuer)
    assert identity_of(cert_pem) == ID
    assert validity(cert_pem).ends == NOW + timedelta(hours=1)
    assert validity(cert_pem).renew_after() == NOW + timedelta(minutes=30)
    assert validity(cert_pem).begins == NOW - SKEW
    assert attempt.validity() == validity(cert_pem)
    assert attempt.files("/var/run/astraeus/identity") == {
        "ASTRAEUS_IDENTITY_KEY": "/var/run/astraeus/identity/key.pem",
        "ASTRAEUS_IDENTITY_CERT": "/var/run/astraeus/identity/cert.pem",
        "ASTRAEUS_IDENTITY_BUNDLE": "/var/run/astraeus/identity/bundle.pem",
    }


def test_a_request_for_another_identity_is_refused(tmp_path: Path) -> None:
    ca = ClusterCA(tmp_path / "ca")
    other = AttemptIdentity(tmp_path / "x").request(spiffe_id("team-b", "llm", "w-0", 3))
    with pytest.raises(IdentityRefused) as refused:
        ca.sign(other, ID, timedelta(hours=1), NOW)
    assert str(refused.value) == f"the request names spiffe://astraeus/ns/team-b/run/llm/worker/w-0/attempt/3, not {ID}"
    with pytest.raises(IdentityRefused) as refused:
        ca.sign(b"not a request", ID, timedelta(hours=1), NOW)
    assert str(refused.value).startswith("not a certificate request: ")


def test_the_ca_is_made_once_and_its_key_is_its_owners_alone(tmp_path: Path) -> None:
    ca = ClusterCA(tmp_path / "ca")
    assert ca.ensure() is True
    first = ca.certificate_pem()
    assert (ca.ensure(), ClusterCA(tmp_path / "ca").certificate_pem()) == (False, first)
    assert ((tmp_path / "ca" / "ca.key").stat().st_mode & 0o777, (tmp_path / "ca").stat().st_mode & 0o777) == (
        0o600,
        0o700,
    )


def test_an_attempt_keeps_its_key_and_renewing_replaces_only_its_certificate(tmp_path: Path) -> None:
    ca = ClusterCA(tmp_path / "ca")
    attempt = AttemptIdentity(tmp_path / "identity" / "a")
    first = attempt.request(ID)
    key = (attempt.directory / "key.pem").read_bytes()
    attempt.keep(ca.sign(first, ID, timedelta(hours=1), NOW), ca.certificate_pem())
    renewed = ca.sign(attempt.request(ID), ID, timedelta(hours=1), NOW + timedelta(minutes=31))
    attempt.keep(renewed, ca.certificate_pem())
    assert (attempt.directory / "key.pem").read_bytes() == key
    assert attempt.validity() == validity(renewed)
    public = x509.load_pem_x509_certificate(renewed).public_key()
    assert isinstance(public, ec.EllipticCurvePublicKey)
