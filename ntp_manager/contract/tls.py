"""Client TLS and mutual TLS for gRPC: credentials from PEM files, for every client of the manager
(agents, workers, tools). The manager's own listener credentials live in rpc/tls.py.

`TlsFiles(ca, cert, key)`: the CA that signed the manager's certificate (None: the system roots),
and the client's own certificate and key for mTLS. No file at all: a plaintext channel. The files
are read again for each channel (a renewed certificate is picked up at the next connection);
`TlsFiles.check()` reads them once at set-up, so a bad path is refused there, in one line naming
the flag, and not by grpcio retrying a connection forever.
"""

from __future__ import annotations

import hashlib
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import grpc

# the variables a worker (ntp-run and its ranks) reads them from; the agent's are NTP_AGENT_TLS_*
ENV_CA, ENV_CERT, ENV_KEY = "NTP_TLS_CA", "NTP_TLS_CERT", "NTP_TLS_KEY"


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise OSError(f"{what} {path}: cannot read ({e.strerror})") from None


def pem(path: Path, what: str, marker: bytes) -> bytes:
    """The file's bytes, refused (OSError) unless it holds a PEM block of that kind: grpcio would
    only log 'Invalid cert chain file' and fail, which reads as a network problem."""
    data = _read(path, what)
    if b"-----BEGIN " not in data or marker not in data:
        kind = marker.decode().strip("-").lower()
        raise OSError(f"{what} {path}: not a PEM {kind} (no '-----BEGIN ...{marker.decode()}' line)")
    return data


def channel_credentials(ca: Path | None, cert: Path | None = None, key: Path | None = None,
                        labels: tuple[str, str, str] = ("CA", "certificate", "key")) -> grpc.ChannelCredentials:
    """Credentials for a client: verify the manager with `ca` (system roots when None) and, with
    `cert` and `key`, present that certificate (mTLS). Raises OSError naming a file that cannot be
    read or holds no PEM block of its kind (grpcio would only log it and retry the connection
    forever); `labels` name the three in that message (a CLI gives its flags)."""
    import grpc

    if (cert is None) != (key is None):
        raise ValueError(f"a client certificate and its key go together ({labels[1]} and {labels[2]})")
    return grpc.ssl_channel_credentials(
        root_certificates=pem(ca, labels[0], b"CERTIFICATE-----") if ca else None,
        private_key=pem(key, labels[2], b"PRIVATE KEY-----") if key else None,
        certificate_chain=pem(cert, labels[1], b"CERTIFICATE-----") if cert else None,
    )


def fingerprint_of_pem(data: bytes | str) -> str:
    """SHA-256 (hex) of a PEM certificate's DER bytes: what `token create --fingerprint` takes."""
    text = data.decode() if isinstance(data, bytes) else data
    return hashlib.sha256(ssl.PEM_cert_to_DER_cert(text)).hexdigest()


@dataclass(frozen=True)
class TlsFiles:
    """How a client reaches the manager: plaintext (nothing given), TLS (`ca`, or the system roots
    with only a certificate) or mTLS (`cert` + `key`). `labels` name the three in error messages."""

    ca: Path | None = None
    cert: Path | None = None
    key: Path | None = None
    labels: tuple[str, str, str] = ("CA", "certificate", "key")

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ValueError(f"{self.labels[1]} and {self.labels[2]} go together")

    @property
    def enabled(self) -> bool:
        """Whether the channel is TLS (a CA or a client certificate was given)."""
        return self.ca is not None or self.cert is not None

    def credentials(self) -> grpc.ChannelCredentials:
        """Fresh credentials from the files (OSError naming a file that cannot be used)."""
        return channel_credentials(self.ca, self.cert, self.key, self.labels)

    def check(self) -> None:
        """Read every file once (set-up): OSError naming the first that cannot be used."""
        if self.enabled:
            self.credentials()

    def describe(self) -> str:
        """How the channel is secured, for a log line or an error."""
        if not self.enabled:
            return "plaintext"
        mode = "mTLS" if self.cert is not None else "TLS"
        return f"{mode}, CA {self.ca}" if self.ca is not None else f"{mode}, the system's CAs"

    def resolved(self) -> TlsFiles:
        """The same files by absolute paths (for a process started elsewhere)."""
        def absolute(p: Path | None) -> Path | None:
            return p.resolve() if p is not None else None

        return TlsFiles(absolute(self.ca), absolute(self.cert), absolute(self.key), labels=self.labels)

    def env(self) -> dict[str, str]:
        """The NTP_TLS_* variables that give these files to another process (`from_env`)."""
        return {name: str(p) for name, p in ((ENV_CA, self.ca), (ENV_CERT, self.cert), (ENV_KEY, self.key))
                if p is not None}

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> TlsFiles:
        """From NTP_TLS_CA / NTP_TLS_CERT / NTP_TLS_KEY (unset or empty: not given)."""
        def path(name: str) -> Path | None:
            v = environ.get(name, "")
            return Path(v) if v else None

        return cls(path(ENV_CA), path(ENV_CERT), path(ENV_KEY), labels=(ENV_CA, ENV_CERT, ENV_KEY))
