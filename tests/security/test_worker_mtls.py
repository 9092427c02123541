"""Workers over mutual TLS (issue 35): the layout watch (worker/sources.py GrpcLayoutSource,
through the contract's manager client) against a manager whose gRPC TLS listener requires client
certificates; a short training run under `ntp-run --tls-*` that gets its layout there; and a
worker whose CA did not sign the manager's certificate, refused at set-up in one line."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from ntp_manager.contract.tls import TlsFiles
from ntp_manager.worker.sources import GrpcLayoutSource
from tests.fakes.agent_client import ScriptedAgent, gpu_uuids
from tests.fakes.pki import Pki, make_pki
from tests.integration.conftest import Service, eventually, running_service, submit_job

ROOT = Path(__file__).resolve().parents[2]
JOB = {"name": "tiny", "tp": 2, "replicas": 1, "local_batch": 4, "min_tp": 1, "heads": 6, "mlp_columns": 96}


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture
async def svc(pki: Pki, tmp_path: Path) -> AsyncIterator[Service]:
    """A manager serving mTLS, with one node of two GPUs (its agent over mTLS) and the job."""
    async with running_service(f"sqlite+aiosqlite:///{tmp_path / 'ntp.db'}", tmp_path, grpc_tls_port=0,
                               grpc_tls_cert=pki.server_cert, grpc_tls_key=pki.server_key,
                               grpc_tls_client_ca=pki.ca) as s:
        assert s.grpc_tls is not None
        agent = ScriptedAgent(s.grpc_tls, await s.agent_token("node-0"), "node-0", "nvl-0", gpu_uuids("node-0", 2),
                              credentials=pki.creds("node-a"))
        await agent.connect()
        await agent.wait_for(lambda: agent.welcome is not None, timeout=15)
        await submit_job(s, JOB)
        try:
            yield s
        finally:
            await agent.close()


def mtls(pki: Pki, ca: Path | None = None) -> TlsFiles:
    cert, key = pki.clients["node-a"]
    return TlsFiles(ca or pki.ca, cert, key)


async def test_the_layout_watch_works_over_mtls(svc: Service, pki: Pki) -> None:
    assert svc.grpc_tls is not None
    gpu = gpu_uuids("node-0", 2)[0]
    source = await asyncio.to_thread(GrpcLayoutSource, svc.grpc_tls, svc.tokens["worker"], "tiny", gpu,
                                     tls=mtls(pki))
    try:
        lay = source.latest()
        assert lay is not None and lay.version == 1 and lay.rank is not None
        assert source.client.tls.enabled and source.target == svc.grpc_tls
        await asyncio.to_thread(source.ack, lay, True, "applied over mTLS")
        await eventually(lambda: gpu in svc.manager.layout_acks.get("tiny", {}).get(1, {}))
    finally:
        source.close()


async def test_a_worker_with_the_wrong_ca_is_refused_in_one_line(svc: Service, pki: Pki) -> None:
    """The worker's side of the handshake fails (a CA that did not sign the manager's
    certificate): refused at once, not after the connect timeout."""
    assert svc.grpc_tls is not None
    tls = mtls(pki, pki.rogue_ca)
    gpu = gpu_uuids("node-0", 2)[0]
    with pytest.raises(RuntimeError) as err:
        # a long connect timeout: the refusal must come from the handshake, not from waiting
        await asyncio.to_thread(GrpcLayoutSource, svc.grpc_tls, svc.tokens["worker"], "tiny", gpu,
                                connect_timeout_s=600, tls=tls)
    line = str(err.value)
    assert "\n" not in line
    assert line.startswith(f"cannot watch the layout of 'tiny': manager {svc.grpc_tls}: the TLS handshake failed")
    assert f"(mTLS, CA {pki.rogue_ca}): the CA did not sign the manager's certificate" in line


async def test_a_client_certificate_the_manager_refuses_is_named_in_the_error(svc: Service, pki: Pki) -> None:
    """A certificate from a CA the manager does not trust, none, or plaintext to the TLS port:
    under TLS 1.3 the worker's side of the handshake succeeds and the manager closes the
    connection; at the connect timeout the error says what to check."""
    assert svc.grpc_tls is not None
    gpu = gpu_uuids("node-0", 2)[0]
    rogue_cert, rogue_key = pki.clients["rogue"]
    for tls in (TlsFiles(pki.ca, rogue_cert, rogue_key), TlsFiles(pki.ca), TlsFiles()):
        with pytest.raises(RuntimeError) as err:
            await asyncio.to_thread(GrpcLayoutSource, svc.grpc_tls, svc.tokens["worker"], "tiny", gpu,
                                    connect_timeout_s=2, tls=tls)
        line = str(err.value)
        assert "\n" not in line and "Socket closed" in line, line
        assert (f"over {tls.describe()}: a manager that requires client certificates closes the connection"
                if tls.enabled else "over plaintext: a TLS port closes plaintext connections") in line


def test_a_bad_tls_file_is_refused_before_any_connection(tmp_path: Path, pki: Pki) -> None:
    with pytest.raises(OSError, match=r"NTP_TLS_CA .*missing.pem: cannot read"):
        GrpcLayoutSource("127.0.0.1:1", "t", "j", "G-0",
                         tls=TlsFiles.from_env({"NTP_TLS_CA": str(tmp_path / "missing.pem")}))
    with pytest.raises(ValueError, match="go together"):
        TlsFiles(pki.ca, pki.clients["node-a"][0], None)


@pytest.mark.slow
async def test_a_short_training_run_gets_its_layout_over_mtls(svc: Service, pki: Pki, tmp_path: Path) -> None:
    """`ntp-run --tls-ca/--tls-cert/--tls-key` hands the files to its ranks (NTP_TLS_*); both ranks
    of the TP2 replica watch the layout over mTLS, train, ack it, and match one process (--check)."""
    assert svc.grpc_tls is not None
    token = tmp_path / "worker.token"
    token.write_text(svc.tokens["worker"])
    cert, key = pki.clients["node-a"]
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "ntp_manager.worker.run", "--manager", svc.grpc_tls, "--token-file", str(token),
        "--job", "tiny", "--gpus", ",".join(gpu_uuids("node-0", 2)), "--device", "cpu",
        "--tls-ca", str(pki.ca), "--tls-cert", str(cert), "--tls-key", str(key),
        "examples/train_tiny_gpt.py", "--steps", "3", "--check",
        cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    out, _ = await asyncio.wait_for(proc.communicate(), 240)
    text = out.decode(errors="replace")
    assert proc.returncode == 0, text[-3000:]
    acks = svc.manager.layout_acks.get("tiny", {}).get(1, {})
    assert set(acks) == set(gpu_uuids("node-0", 2)), acks
