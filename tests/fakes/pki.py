"""A test PKI made with the `cryptography` package: a CA, the manager's server certificate (for
localhost and 127.0.0.1), node certificates, and a certificate from a CA nobody trusts.

    pki = make_pki(tmp_path, clients=("node-a", "node-b"))
    pki.ca, pki.server_cert, pki.server_key, pki.clients["node-a"], pki.rogue_ca, pki.clients["rogue"]
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from ntp_manager.contract.tls import channel_credentials, fingerprint_of_pem


@dataclass
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    clients: dict[str, tuple[Path, Path]]  # name -> (cert, key); "rogue" is signed by rogue_ca
    rogue_ca: Path  # a CA that signed nothing the manager holds

    def fingerprint(self, name: str) -> str:
        return fingerprint_of_pem(self.clients[name][0].read_bytes())

    def creds(self, name: str | None) -> grpc.ChannelCredentials:
        if name is None:
            return channel_credentials(self.ca)
        cert, key = self.clients[name]
        return channel_credentials(self.ca, cert, key)


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _issue(dir: Path, stem: str, cn: str, issuer: tuple[x509.Certificate, ec.EllipticCurvePrivateKey] | None,
           *, ca: bool = False, server: bool = False) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    b = (x509.CertificateBuilder().subject_name(_name(cn))
         .issuer_name(issuer[0].subject if issuer else _name(cn))
         .public_key(key.public_key()).serial_number(x509.random_serial_number())
         .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=1))
         .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if server:
        b = b.add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                         x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                            critical=False)
    cert = b.sign(issuer[1] if issuer else key, hashes.SHA256())
    (dir / f"{stem}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (dir / f"{stem}.key").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                        serialization.PrivateFormat.PKCS8,
                                                        serialization.NoEncryption()))
    return cert, key


def make_pki(d: Path, clients: Sequence[str] = ("node-a", "node-b")) -> Pki:
    """Write the PKI's files into `d`."""
    d.mkdir(parents=True, exist_ok=True)
    ca = _issue(d, "ca", "ntp test CA", None, ca=True)
    _issue(d, "server", "manager", ca, server=True)
    for n in clients:
        _issue(d, n, n, ca)
    rogue = _issue(d, "rogue-ca", "rogue CA", None, ca=True)
    _issue(d, "rogue", clients[0] if clients else "rogue", rogue)
    return Pki(d / "ca.pem", d / "server.pem", d / "server.key",
               {n: (d / f"{n}.pem", d / f"{n}.key") for n in (*clients, "rogue")}, d / "rogue-ca.pem")
