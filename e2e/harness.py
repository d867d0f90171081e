"""A real control plane for e2e tests: etcd and kube-apiserver (built by e2e/cluster/build.sh)
on loopback, with envtest-style flags, a client-certificate admin user and a kubeconfig.

Nothing here fakes the API: the binaries are upstream's, and tests talk to them over HTTPS.
"""

from __future__ import annotations

import datetime
import json
import os
import ssl
import subprocess
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import NameOID

from istiod.ca.pki import key_pem
from tests.peers import free_port, stop_group, wait_until

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(os.environ.get("E2E_BIN", ROOT / ".cache" / "e2e-bin"))


def _name(common_name: str, organization: str | None = None) -> x509.Name:
    attributes = [x509.NameAttribute(NameOID.COMMON_NAME, common_name)]
    if organization:
        attributes.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, organization))
    return x509.Name(attributes)


@dataclass(frozen=True)
class Credentials:
    """The files the API server and its admin client need, made once per test session."""

    ca_cert: Path
    admin_cert: Path
    admin_key: Path
    sa_key: Path
    sa_pub: Path

    @classmethod
    def create(cls, directory: Path) -> Credentials:
        now = datetime.datetime.now(datetime.timezone.utc)
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca = (
            x509.CertificateBuilder()
            .subject_name(_name("e2e-client-ca")).issuer_name(_name("e2e-client-ca"))
            .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(ca_key, hashes.SHA256())
        )
        admin_key = ec.generate_private_key(ec.SECP256R1())
        admin = (
            x509.CertificateBuilder()
            .subject_name(_name("e2e-admin", "system:masters")).issuer_name(ca.subject)
            .public_key(admin_key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256())
        )
        sa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        creds = cls(directory / "ca.crt", directory / "admin.crt", directory / "admin.key",
                    directory / "sa.key", directory / "sa.pub")
        creds.ca_cert.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
        creds.admin_cert.write_bytes(admin.public_bytes(serialization.Encoding.PEM))
        for path, key in ((creds.admin_key, admin_key), (creds.sa_key, sa_key)):
            path.write_bytes(key_pem(key))
            path.chmod(0o600)
        creds.sa_pub.write_bytes(sa_key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
        return creds


class _Daemon:
    def __init__(self, name: str, args: list[str], log: Path) -> None:
        self.name = name
        self.args = args
        self.log_path = log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def stop(self) -> None:
        if self.proc is not None:
            stop_group(self.proc, grace=15)
        self.proc = None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def tail(self, lines: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


class ApiServer:
    """One kube-apiserver process against the cluster's etcd, with its own port and kubeconfig."""

    def __init__(self, workdir: Path, name: str, etcd_url: str, creds: Credentials,
                 service_cidr: str = "10.0.0.0/24") -> None:
        self.port = free_port()
        self.url = f"https://127.0.0.1:{self.port}"
        self.creds = creds
        self.cert_dir = workdir / f"{name}-certs"
        self.kubeconfig = workdir / f"{name}.kubeconfig"
        self.daemon = _Daemon(name, [
            str(BIN / "kube-apiserver"),
            f"--etcd-servers={etcd_url}",
            f"--cert-dir={self.cert_dir}",
            "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1", f"--secure-port={self.port}",
            f"--client-ca-file={creds.ca_cert}",
            "--authorization-mode=RBAC",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={creds.sa_pub}",
            f"--service-account-signing-key-file={creds.sa_key}",
            f"--service-cluster-ip-range={service_cidr}",
            "--allow-privileged=true",
            # Watches go straight to etcd, so a compaction really expires old resourceVersions.
            "--watch-cache=false",
            # JSON in etcd, so tests can plant objects the API's validation would refuse.
            "--storage-media-type=application/json",
            "--disable-admission-plugins=ServiceAccount",
            # The kubernetes Service cannot point at loopback; nothing here needs it.
            "--endpoint-reconciler-type=none",
            "--v=1",
        ], workdir / f"{name}.log")

    def start(self) -> None:
        self.daemon.start()
        wait_until(lambda: self.ready() or not self.daemon.alive(), 120, f"{self.daemon.name} /readyz")
        if not self.daemon.alive():
            raise RuntimeError(f"{self.daemon.name} exited:\n{self.daemon.tail()}")
        self._write_kubeconfig()

    def stop(self) -> None:
        self.daemon.stop()

    def ssl_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=str(self.cert_dir / "apiserver.crt"))
        context.load_cert_chain(self.creds.admin_cert, self.creds.admin_key)
        return context

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/readyz", context=self.ssl_context(), timeout=2) as reply:
                return reply.status == 200
        except (OSError, ssl.SSLError):
            return False

    def post(self, path: str, body: dict[str, object]) -> None:
        """A create as the admin user, for what the session needs before any test's client exists."""
        request = urllib.request.Request(f"{self.url}{path}", data=json.dumps(body).encode(), method="POST",
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, context=self.ssl_context(), timeout=10) as reply:
            assert reply.status == 201, reply.status

    def _write_kubeconfig(self) -> None:
        self.kubeconfig.write_text(f"""apiVersion: v1
kind: Config
clusters:
- name: e2e
  cluster: {{server: "{self.url}", certificate-authority: "{self.cert_dir / 'apiserver.crt'}"}}
users:
- name: admin
  user: {{client-certificate: "{self.creds.admin_cert}", client-key: "{self.creds.admin_key}"}}
contexts:
- name: e2e
  context: {{cluster: e2e, user: admin}}
current-context: e2e
""")


class Cluster:
    """etcd + kube-apiserver on 127.0.0.1; restartable, so tests can break the API under istiod."""

    def __init__(self, workdir: Path, service_cidr: str = "10.0.0.0/24") -> None:
        """`service_cidr`: the Services' ClusterIP range (a /24 holds 254 Services)."""
        for binary in ("etcd", "kube-apiserver"):
            if not (BIN / binary).exists():
                raise RuntimeError(f"e2e: {BIN / binary} is missing; run `make e2e-bin` (needs Go on PATH)")
        self.workdir = workdir
        self.creds = Credentials.create(workdir)
        self.etcd_url = f"http://127.0.0.1:{free_port()}"
        self.etcd = _Daemon("etcd", [
            str(BIN / "etcd"), "--data-dir", str(workdir / "etcd-data"),
            "--listen-client-urls", self.etcd_url, "--advertise-client-urls", self.etcd_url,
            "--listen-peer-urls", f"http://127.0.0.1:{free_port()}",
        ], workdir / "etcd.log")
        self.apiserver = ApiServer(workdir, "kube-apiserver", self.etcd_url, self.creds, service_cidr)
        self.kubeconfig = self.apiserver.kubeconfig

    def start(self) -> None:
        self.start_etcd()
        self.apiserver.start()
        self.apiserver.post("/api/v1/namespaces", {"metadata": {"name": "istio-system"}})

    def start_etcd(self) -> None:
        ready_lines = self.etcd.log_path.read_text().count("etcd ready") if self.etcd.log_path.exists() else 0
        self.etcd.start()
        wait_until(lambda: self.etcd.log_path.read_text(errors="replace").count("etcd ready") > ready_lines
                   or not self.etcd.alive(), 60, "etcd to be ready")
        if not self.etcd.alive():
            raise RuntimeError(f"etcd exited:\n{self.etcd.tail()}")

    def second_apiserver(self) -> ApiServer:
        """Another API server on the same etcd, as in an HA control plane."""
        server = ApiServer(self.workdir, "kube-apiserver-2", self.etcd_url, self.creds)
        server.start()
        return server

    def stop(self) -> None:
        self.apiserver.stop()
        self.etcd.stop()

    def compact(self) -> int:
        """Compact etcd to its current revision: every older resourceVersion is now gone."""
        return self._etcd_command("compact")

    def plant(self, key: str, value: str) -> int:
        """Write an object straight into etcd (JSON storage), past the API's validation."""
        return self._etcd_command("put", key, stdin=value)

    def _etcd_command(self, command: str, *args: str, stdin: str = "") -> int:
        """Run `etcd <command>` against this cluster; it prints the store's revision."""
        out = subprocess.run([str(BIN / "etcd"), command, "--endpoint", self.etcd_url, *args], input=stdin,
                             capture_output=True, text=True, timeout=30, check=True)
        return int(out.stdout.strip().splitlines()[-1])
