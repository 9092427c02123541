"""TLS and mutual TLS for the manager's gRPC listener: credentials from PEM files.

Manager (settings, docs/security.md): `grpc_tls_cert` + `grpc_tls_key` open a TLS listener on
`grpc_tls_port` beside the plaintext one (which stays on loopback unless told otherwise); adding
`grpc_tls_client_ca` makes that listener require a client certificate signed by that CA, and makes
the agent service refuse agents that did not come through it. An agent token may further be tied
to one certificate by its SHA-256 fingerprint (`token create --scope agent --node N
--fingerprint SHA256`), so a stolen token is useless without that node's key.

Clients' credentials (agents, workers) are the contract's: contract/tls.py.
"""

from __future__ import annotations

from typing import Any

import grpc

from ntp_manager.contract.tls import channel_credentials, fingerprint_of_pem, pem

__all__ = ["channel_credentials", "fingerprint_of_pem", "server_credentials"]


def server_credentials(settings: Any) -> grpc.ServerCredentials | None:
    """The TLS listener's credentials, or None when no certificate is configured. Raises OSError
    naming an unreadable file."""
    if settings.grpc_tls_cert is None:
        return None
    cert = pem(settings.grpc_tls_cert, "grpc_tls_cert", b"CERTIFICATE-----")
    key = pem(settings.grpc_tls_key, "grpc_tls_key", b"PRIVATE KEY-----")
    ca = pem(settings.grpc_tls_client_ca, "grpc_tls_client_ca", b"CERTIFICATE-----") \
        if settings.grpc_tls_client_ca else None
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=ca is not None)
