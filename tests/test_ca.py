"""Unit tests of the CA: signing, TTL limits, root persistence, plugged-in CA and its reload,
identity from the caller, and the authenticators (without any API server)."""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.x509.verification import PolicyBuilder, Store
from kubernetes_asyncio.client import V1TokenReviewStatus, V1UserInfo

from istiod.ca.authenticate import (
    AuthenticationError, Caller, ClientCertAuthenticator, Credentials, StaticTokenAuthenticator, authenticate,
    service_account_of, token_review_account,
)
from istiod.agent.settings import add_agent_flags, agent_settings_from_args
from istiod.ca.pki import cert_pem, key_pem, load_certs, new_key, subject_key_identifier, uri_sans
from istiod.ca.root import CertificateAuthority, bundle_from_pem
from istiod.ca.selfsigned import (
    DirRootStore, RootRotator, StoredRoot, rotated, self_signed_bundle, self_signed_root, stored_bundle,
)
from istiod.ca.serving import ServingCertificate, serving_names
from istiod.ca.settings import RootPolicy
from istiod.ca.signer import SignError, SignErrorKind, TtlPolicy, sign_csr
from istiod.model.mesh import MeshConfig
from istiod.model.names import parse_spiffe_identity, spiffe_identity
from istiod.sources.convert import ConversionError, convert
from tests.peers import eventually
from tests.pki import KEY_ID_STYLES, NOW, ca_cert, csr_claiming_other_key, csr_pem, write_plugged

TD = "cluster.local"
CALLER = ("spiffe://cluster.local/ns/app/sa/web",)


@pytest.fixture
async def bundle(tmp_path: Path):
    return await self_signed_bundle(DirRootStore(tmp_path), TD)


def verified_uris(chain: list[str]) -> list[str]:
    """Verify the chain as a TLS peer would (RFC 5280 client profile) and return its URI SANs."""
    certs = [load_certs(pem.encode(), "chain")[0] for pem in chain]
    verifier = PolicyBuilder().store(Store([certs[-1]])).build_client_verifier()
    return [n.value for n in verifier.verify(certs[0], certs[1:-1]).subjects if isinstance(n, x509.UniformResourceIdentifier)]


async def test_identity_comes_from_the_caller_not_the_csr(bundle) -> None:
    chain = sign_csr(bundle, csr_pem(new_key(), "spiffe://cluster.local/ns/evil/sa/admin"), CALLER, 0, TtlPolicy(), NOW)
    assert len(chain) == 2 and chain[-1] == bundle.roots_pem
    assert verified_uris(chain) == list(CALLER)


async def test_default_and_requested_ttl(bundle) -> None:
    for requested, expected in ((0, timedelta(hours=24)), (3600, timedelta(hours=1))):
        leaf = load_certs(sign_csr(bundle, csr_pem(new_key()), CALLER, requested, TtlPolicy(), NOW)[0].encode(), "x")[0]
        assert leaf.not_valid_after_utc - leaf.not_valid_before_utc == expected


async def test_ttl_over_the_max_is_refused(bundle) -> None:
    with pytest.raises(SignError) as refused:
        sign_csr(bundle, csr_pem(new_key()), CALLER, 90 * 86400 + 1, TtlPolicy(), NOW)
    assert refused.value.kind is SignErrorKind.TTL
    assert str(refused.value) == "requested TTL 2160h0m1s is greater than the max allowed TTL 2160h0m0s"


@pytest.mark.parametrize("csr, message", [
    ("hello", "certificate signing request is not properly encoded"),
    ("-----BEGIN CERTIFICATE REQUEST-----\nAAAA\n-----END CERTIFICATE REQUEST-----\n",
     "failed to parse X.509 certificate signing request"),
    # 64 KiB is parsed; one byte more is not.
    ("-----BEGIN CERTIFICATE REQUEST-----\n" + "A" * 65500, "failed to parse X.509 certificate signing request"),
    ("-----BEGIN CERTIFICATE REQUEST-----\n" + "A" * 65501, "certificate signing request is 65537 bytes, over the limit of 65536"),
])
async def test_garbage_csr(bundle, csr: str, message: str) -> None:
    with pytest.raises(SignError) as refused:
        sign_csr(bundle, csr, CALLER, 0, TtlPolicy(), NOW)
    assert (refused.value.kind, str(refused.value)) == (SignErrorKind.CSR, message)


async def test_csr_signed_by_another_key_than_it_claims(bundle) -> None:
    with pytest.raises(SignError) as refused:
        sign_csr(bundle, csr_claiming_other_key(new_key(), new_key()), CALLER, 0, TtlPolicy(), NOW)
    assert str(refused.value) == "certificate signing request signature does not match its public key"


async def test_root_is_created_once_and_kept(tmp_path: Path) -> None:
    first, second = await asyncio.gather(self_signed_bundle(DirRootStore(tmp_path), TD),
                                         self_signed_bundle(DirRootStore(tmp_path), TD))
    assert first.root == second.root  # two "replicas" racing agree on one root
    again = await self_signed_bundle(DirRootStore(tmp_path), TD)
    assert again.root == first.root and again.key.private_numbers() == first.key.private_numbers()
    assert (tmp_path / "istio-ca-secret" / "ca-key.pem").stat().st_mode & 0o077 == 0
    assert first.root.subject.rfc4514_string() == "O=cluster.local"
    assert [p.name for p in tmp_path.iterdir()] == ["istio-ca-secret"]  # no staging left behind


async def test_plugged_ca_with_intermediate(tmp_path: Path) -> None:
    root, intermediate = write_plugged(tmp_path / "cacerts")
    ca = CertificateAuthority.plugged(tmp_path / "cacerts")
    chain = sign_csr(ca.bundle, csr_pem(new_key()), CALLER, 0, TtlPolicy(), NOW)
    assert [load_certs(c.encode(), "c")[0] for c in chain[1:]] == [intermediate, root]
    assert verified_uris(chain) == list(CALLER)


@pytest.mark.parametrize("breakage, message", [
    ("key", "ca-key.pem is not the key of ca-cert.pem"),
    ("root", "ca-cert.pem does not chain to any certificate in root-cert.pem"),
    ("missing", "No such file or directory"),
])
async def test_bad_plugged_ca_is_refused(tmp_path: Path, breakage: str, message: str) -> None:
    write_plugged(tmp_path / "cacerts")
    write_plugged(tmp_path / "other")
    if breakage == "key":
        shutil.copy(tmp_path / "other/ca-key.pem", tmp_path / "cacerts/ca-key.pem")
    elif breakage == "root":
        shutil.copy(tmp_path / "other/root-cert.pem", tmp_path / "cacerts/root-cert.pem")
        (tmp_path / "cacerts/cert-chain.pem").unlink()
    else:
        (tmp_path / "cacerts/root-cert.pem").unlink()
    with pytest.raises(ValueError, match=message):
        CertificateAuthority.plugged(tmp_path / "cacerts")


async def test_plugged_ca_reloads_and_keeps_the_old_one_on_bad_files(tmp_path: Path) -> None:
    directory = tmp_path / "cacerts"
    first_root, _ = write_plugged(directory, "first")
    ca = CertificateAuthority.plugged(directory)
    changes: list[x509.Certificate] = []
    watch = asyncio.create_task(ca.watch(0.05, lambda b: changes.append(b.root)))
    try:
        second_root, _ = write_plugged(directory, "second")
        await eventually(lambda: changes, 5, "the reloaded CA", interval=0.02)
        assert ca.bundle.root == second_root != first_root
        (directory / "ca-key.pem").write_text("not a key")
        await asyncio.sleep(0.3)
        assert ca.bundle.root == second_root and changes == [second_root]
    finally:
        watch.cancel()


def test_bundle_needs_a_ca_certificate(tmp_path: Path) -> None:
    write_plugged(tmp_path)
    leaf_like = (tmp_path / "ca-cert.pem").read_bytes()
    with pytest.raises(ValueError, match="no PEM certificate"):
        bundle_from_pem(b"junk", b"", b"", leaf_like)


async def test_static_tokens_and_client_certs(tmp_path: Path, bundle) -> None:
    tokens = tmp_path / "tokens.json"
    tokens.write_text('{"s3cret-token": "app/web"}')
    static = StaticTokenAuthenticator.from_file(tokens, TD)
    chain = (ClientCertAuthenticator(MeshConfig), static)
    by_token = await authenticate(chain, Credentials("Bearer s3cret-token"))
    assert by_token == Caller(CALLER, "StaticTokenAuthenticator", ("app", "web"))
    leaf = load_certs(sign_csr(bundle, csr_pem(new_key()), CALLER, 0, TtlPolicy(), NOW)[0].encode(), "leaf")[0]
    assert (await authenticate(chain, Credentials(None, leaf))).identities == CALLER
    for credentials, message in (
        (Credentials(), "no client certificate or bearer token is presented"),
        (Credentials("Basic abc"), "target JWT extraction error: no bearer token exists in HTTP authorization header"),
        (Credentials("Bearer wrong-token"), "StaticTokenAuthenticator: the token is not in the static token file"),
    ):
        with pytest.raises(AuthenticationError) as refused:
            await authenticate(chain, credentials)
        assert message in str(refused.value) and "wrong-token" not in str(refused.value) + refused.value.detail
        # The caller hears only of what it presented; the log has every authenticator's reason.
        assert "ClientCertAuthenticator" not in str(refused.value)
        assert "ClientCertAuthenticator: no client certificate is presented" in refused.value.detail
    assert "s3cret" not in repr(Credentials("Bearer s3cret-token"))


def test_static_token_file_errors_name_the_entry_not_the_token(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens.json"
    tokens.write_text('{"good": "a/b", "s3cret": "no-slash"}')
    with pytest.raises(ValueError) as bad:
        StaticTokenAuthenticator.from_file(tokens, TD)
    assert "entry #2: must map to 'namespace/serviceaccount'" in str(bad.value) and "s3cret" not in str(bad.value)


HOSTILE_ACCOUNTS = ("ns/../sa/x", "demo?x=1#/web", "app/web?x=1#", "App/web", "app/", "/web", "app/web/x",
                    "app/we b", "app/" + "w" * 64, "app/web.v1")


@pytest.mark.parametrize("account", HOSTILE_ACCOUNTS)
def test_static_token_accounts_are_dns_labels(tmp_path: Path, account: str) -> None:
    """Text that would put another account, a query or a fragment into the SPIFFE URI is refused at load."""
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps({"good": "a/b", "s3cret": account}))
    with pytest.raises(ValueError) as bad:
        StaticTokenAuthenticator.from_file(tokens, TD)
    print(bad.value)
    assert "entry #2" in str(bad.value) and "s3cret" not in str(bad.value)


@pytest.mark.parametrize("account", HOSTILE_ACCOUNTS)
def test_every_identity_builder_refuses_what_is_not_a_dns_label(account: str) -> None:
    namespace, _, service_account = account.partition("/")
    with pytest.raises(ValueError):
        spiffe_identity(TD, namespace, service_account)
    with pytest.raises(ValueError, match="invalid username field"):
        service_account_of(f"system:serviceaccount:{namespace}:{service_account}")
    assert parse_spiffe_identity(f"spiffe://{TD}/ns/{namespace}/sa/{service_account}") is None
    with pytest.raises(SystemExit, match="is not a DNS-1123 label"):
        agent_settings_from_args(agent_parser().parse_args(
            ["--pod-name", "p", "--pod-namespace", namespace, "--instance-ip", "10.0.0.1",
             "--service-account", service_account]))
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": "app"},
           "spec": {"serviceAccountName": service_account or "x?y"}}
    if namespace == "app":
        with pytest.raises(ConversionError, match="serviceAccountName"):
            convert(pod)


def agent_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_agent_flags(parser)
    return parser


def test_token_review_results() -> None:
    def status(**fields: object) -> V1TokenReviewStatus:
        return V1TokenReviewStatus(**fields)

    ok = status(authenticated=True, user=V1UserInfo(username="system:serviceaccount:app:web",
                                                    groups=["system:serviceaccounts", "system:serviceaccounts:app"]))
    assert token_review_account(ok) == ("app", "web")
    for review, message in (
        (status(authenticated=False, error='token audiences ["other"] is invalid for the target audiences ["istio-ca"]'),
         'the service account authentication returns an error: token audiences ["other"] is invalid'),
        (status(authenticated=False), "the token is not authenticated"),
        (status(authenticated=True, user=V1UserInfo(username="alice", groups=["system:authenticated"])),
         "the token is not a service account"),
        (status(authenticated=True, user=V1UserInfo(username="system:serviceaccount:app", groups=["system:serviceaccounts"])),
         "invalid username field in the token review result"),
    ):
        with pytest.raises(ValueError) as refused:
            token_review_account(review)
        assert str(refused.value).startswith(message)
    assert service_account_of("system:serviceaccount:ns:sa") == ("ns", "sa")
    for bad in ("system:serviceaccount:ns", "system:node:ns:sa", "system:serviceaccount::sa"):
        with pytest.raises(ValueError):
            service_account_of(bad)


def test_leaf_profile(tmp_path: Path) -> None:
    """What a workload certificate looks like: empty subject, critical URI SAN, not a CA, both EKUs."""
    bundle = asyncio.run(self_signed_bundle(DirRootStore(tmp_path), TD))
    leaf = load_certs(sign_csr(bundle, csr_pem(new_key()), CALLER, 0, TtlPolicy(), NOW)[0].encode(), "leaf")[0]
    assert leaf.subject == x509.Name([]) and uri_sans(leaf) == list(CALLER)
    assert leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).critical
    assert not leaf.extensions.get_extension_for_class(x509.BasicConstraints).value.ca


async def test_client_certificate_without_spiffe_identity(tmp_path: Path, bundle) -> None:
    """istiod's own (DNS-only) certificate is from the CA but names no workload: an ID extraction error."""
    from istiod.ca.serving import issue, serving_names

    leaf = issue(bundle, new_key().public_key(), serving_names("istio-system", TD), NOW, timedelta(hours=1))
    with pytest.raises(AuthenticationError) as refused:
        await authenticate([ClientCertAuthenticator(MeshConfig)], Credentials(None, leaf))
    assert refused.value.no_identity
    assert str(refused.value) == "ClientCertAuthenticator: the client certificate has no SPIFFE URI SAN"


async def test_serving_certificate_renews_at_half_life_off_the_accept_path(tmp_path: Path) -> None:
    serving = ServingCertificate(CertificateAuthority(await self_signed_bundle(DirRootStore(tmp_path), TD)),
                                 serving_names("istio-system", "cluster.local"), timedelta(seconds=2))
    first_context, first = serving.ssl_context(), serving.cert
    assert serving.ssl_context() is first_context  # no work per connection
    renewal = asyncio.create_task(serving.keep_fresh(0.05))
    try:
        await eventually(lambda: serving.cert is not first, 5, "the renewed serving certificate")
    finally:
        renewal.cancel()
    assert serving.ssl_context() is not first_context
    assert serving.cert is not None and first is not None and serving.cert.serial_number != first.serial_number


@pytest.mark.parametrize("key_ids", KEY_ID_STYLES)
async def test_leaves_copy_the_issuers_key_identifier_and_a_rotated_root_keeps_it(tmp_path: Path, key_ids: str) -> None:
    """A root istiod did not make (Istio's istiod hashes keys with Go's truncated SHA-256, OpenSSL with
    SHA-1, some tools not at all): leaves name its identifier as it is, and rotation keeps it, so
    leaves signed before still chain to the new root alone."""
    key = new_key()
    root = ca_cert("cluster.local", key, key_ids=key_ids)
    stored = StoredRoot(cert_pem(root).encode(), key_pem(key))
    old_leaf = load_certs(sign_csr(stored_bundle(stored, NOW), csr_pem(new_key()), CALLER, 0, TtlPolicy(), NOW)[0].encode(),
                          "leaf")[0]
    new_root = load_certs(rotated(stored, NOW, timedelta(days=30)).cert, "rotated")[0]
    assert new_root.serial_number != root.serial_number
    assert subject_key_identifier(new_root) == subject_key_identifier(root)
    expected = subject_key_identifier(root)
    try:
        found = old_leaf.extensions.get_extension_for_class(x509.AuthorityKeyIdentifier).value.key_identifier
    except x509.ExtensionNotFound:
        found = None
    assert found == (expected.digest if expected else None)


async def test_rotator_adopts_another_replicas_rotation_and_drops_expired_roots(tmp_path: Path) -> None:
    store, policy = DirRootStore(tmp_path), RootPolicy(ttl=timedelta(seconds=100))
    ca = CertificateAuthority(await self_signed_bundle(store, TD, policy))
    first, changes = ca.bundle, []
    rotator = RootRotator(store, ca, policy, changes.append)
    await rotator.check()
    assert ca.bundle is first and changes == []  # 100 s left of 100 s: not due

    stored = await store.load()
    theirs = await store.replace(stored, rotated(stored, datetime.now(timezone.utc), policy.ttl))  # another replica's
    assert await store.replace(stored, rotated(stored, datetime.now(timezone.utc), policy.ttl)) == theirs  # a late one loses
    await rotator.check()
    assert cert_pem(ca.bundle.cert).encode() == theirs.cert and ca.bundle.roots[1] == first.cert
    assert changes == [ca.bundle]

    expired = load_certs(self_signed_root(TD, NOW - timedelta(days=2), timedelta(days=1)).cert, "expired")[0]
    (store.path / "root-cert.pem").write_text(cert_pem(ca.bundle.cert) + cert_pem(expired))
    await rotator.check()
    assert ca.bundle.roots == (ca.bundle.cert,) and len(changes) == 2
