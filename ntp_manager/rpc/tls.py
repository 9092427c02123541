"""TLS and mutual TLS for gRPC: credentials from PEM files, for the manager and for its clients.

Manager (settings, docs/security.md): `grpc_tls_cert` + `grpc_tls_key` open a TLS listener on
`grpc_tls_port` beside the plaintext one (which stays on loopback unless told otherwise); adding
`grpc_tls_client_ca` makes that listener require a client certificate signed by that CA, and makes
the agent service refuse agents that did not come through it. An agent token may further be tied
to one certificate by its SHA-256 fingerprint (`token create --scope agent --node N
--fingerprint SHA256`), so a stolen token is useless without that node's key.

Clients: `channel_credentials(ca, cert, key)`: the CA that signed the manager's certificate, and
the client's own certificate and key for mTLS.
"""

from __future__ import annotations

import hashlib
import ssl
from pathlib import Path
from typing import Any

import grpc


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise OSError(f"{what} {path}: cannot read ({e.strerror})") from None


def _pem(path: Path, what: str, marker: bytes) -> bytes:
    """The file's bytes, refused (OSError) unless it holds a PEM block of that kind: grpcio would
    only log 'Invalid cert chain file' and fail to bind, which reads as a port problem."""
    data = _read(path, what)
    if b"-----BEGIN " not in data or marker not in data:
        kind = marker.decode().strip("-").lower()
        raise OSError(f"{what} {path}: not a PEM {kind} (no '-----BEGIN ...{marker.decode()}' line)")
    return data


def server_credentials(settings: Any) -> grpc.ServerCredentials | None:
    """The TLS listener's credentials, or None when no certificate is configured. Raises OSError
    naming an unreadable file."""
    if settings.grpc_tls_cert is None:
        return None
    cert = _pem(settings.grpc_tls_cert, "grpc_tls_cert", b"CERTIFICATE-----")
    key = _pem(settings.grpc_tls_key, "grpc_tls_key", b"PRIVATE KEY-----")
    ca = _pem(settings.grpc_tls_client_ca, "grpc_tls_client_ca", b"CERTIFICATE-----") \
        if settings.grpc_tls_client_ca else None
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=ca is not None)


def channel_credentials(ca: Path | None, cert: Path | None = None, key: Path | None = None,
                        labels: tuple[str, str, str] = ("CA", "certificate", "key")) -> grpc.ChannelCredentials:
    """Credentials for a client: verify the manager with `ca` (system roots when None) and, with
    `cert` and `key`, present that certificate (mTLS). Raises OSError naming a file that cannot be
    read or holds no PEM block of its kind (grpcio would only log it and retry the connection
    forever); `labels` name the three in that message (a CLI gives its flags)."""
    if (cert is None) != (key is None):
        raise ValueError("a client certificate and its key go together")
    return grpc.ssl_channel_credentials(
        root_certificates=_pem(ca, labels[0], b"CERTIFICATE-----") if ca else None,
        private_key=_pem(key, labels[2], b"PRIVATE KEY-----") if key else None,
        certificate_chain=_pem(cert, labels[1], b"CERTIFICATE-----") if cert else None,
    )


def fingerprint_of_pem(pem: bytes | str) -> str:
    """SHA-256 (hex) of a PEM certificate's DER bytes: what `token create --fingerprint` takes."""
    text = pem.decode() if isinstance(pem, bytes) else pem
    return hashlib.sha256(ssl.PEM_cert_to_DER_cert(text)).hexdigest()
