"""The checked-in stubs must equal a fresh generation from proto/ (run `make proto` to fix)."""

from pathlib import Path

from ntp_manager import protogen


def test_checked_in_stubs_match_fresh_generation(tmp_path: Path):
    fresh = protogen.generate(tmp_path)
    assert fresh, "no stubs generated"
    for f in fresh:
        rel = f.relative_to(tmp_path)
        checked_in = protogen.OUT_DIR / rel
        assert checked_in.exists(), f"{rel} is missing: run `make proto`"
        assert checked_in.read_text() == f.read_text(), f"{rel} is stale: run `make proto`"
    names = {f.name for f in fresh}
    stale = {p.name for p in (protogen.OUT_DIR / "ntp" / "v1").glob("*_pb2*.py*")} - names
    assert not stale, f"stubs without a .proto: {stale}"


def test_stubs_import_and_round_trip():
    from ntp_manager.contract.proto.ntp.v1 import agent_pb2, common_pb2, worker_pb2, worker_pb2_grpc

    layout = common_pb2.Layout(
        job="j", stamp=common_pb2.LayoutStamp(leader_epoch=1, version=7),
        replicas=[common_pb2.ReplicaSummary(replica_id=0, tp=3, local_batch=6)],
    )
    again = common_pb2.Layout.FromString(layout.SerializeToString())
    assert again.stamp.version == 7 and again.replicas[0].tp == 3
    msg = agent_pb2.AgentMessage(report=agent_pb2.HealthReport(seq=5))
    assert msg.WhichOneof("body") == "report"
    assert hasattr(worker_pb2_grpc, "WorkerServiceStub")
    report = worker_pb2.StepReport(ranks=[worker_pb2.RankStep(sequence_lengths=[1, 2])])
    assert report.ranks[0].sequence_lengths == [1, 2]
