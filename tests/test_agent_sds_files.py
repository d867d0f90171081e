"""The agent's SDS names for files in the pod (pilot-agent's `file-cert:<cert>~<key>` and
`file-root:<ca>`): parsed, read and made into secrets; bad names and unreadable files refused naming them."""

from __future__ import annotations

from pathlib import Path

import pytest

from istiod.agent.sds import file_secret, read_files, secret_files
from istiod.model.credentials import file_cert_resource, file_resource_paths, file_root_resource


def test_names_round_trip_and_malformed_ones_are_refused() -> None:
    assert file_cert_resource("/etc/gw/tls.crt", "/etc/gw/tls.key") == "file-cert:/etc/gw/tls.crt~/etc/gw/tls.key"
    assert file_resource_paths("file-cert:/etc/gw/tls.crt~/etc/gw/tls.key") == ("/etc/gw/tls.crt", "/etc/gw/tls.key")
    assert file_resource_paths(file_root_resource("/etc/gw/ca.crt")) == ("/etc/gw/ca.crt",)
    assert file_resource_paths("default") is None and file_resource_paths("kubernetes://web-cert") is None
    for bad in ("file-cert:/etc/gw/tls.crt", "file-cert:~/k", "file-root:"):
        with pytest.raises(ValueError, match="secret 'file-"):
            file_resource_paths(bad)


def test_file_secrets_carry_the_files_content(tmp_path: Path) -> None:
    (tmp_path / "c.pem").write_bytes(b"CERT")
    (tmp_path / "k.pem").write_bytes(b"KEY")
    names = (file_cert_resource(str(tmp_path / "c.pem"), str(tmp_path / "k.pem")), file_root_resource(str(tmp_path / "c.pem")))
    paths = secret_files(names)
    assert paths == (str(tmp_path / "c.pem"), str(tmp_path / "k.pem"))  # each file once
    files = read_files(paths)
    cert, root = (file_secret(name, files) for name in names)
    assert cert is not None and root is not None
    assert (cert.tls_certificate.certificate_chain.inline_bytes, cert.tls_certificate.private_key.inline_bytes) == (
        b"CERT", b"KEY")
    assert root.validation_context.trusted_ca.inline_bytes == b"CERT"
    assert file_secret("ROOTCA", files) is None


def test_an_unreadable_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=f"cannot read {tmp_path}/missing.pem: No such file or directory"):
        read_files((str(tmp_path / "missing.pem"),))
