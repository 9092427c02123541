import pytest

from ntp_manager.contract.gpu import GpuState
from ntp_manager.specfile import SpecError, cluster_from_dict, job_from_dict
from ntp_manager.topology import Cluster, Domain, Gpu, TopologyError, generate_cluster


def test_generated_cluster_is_deterministic_and_shaped():
    a = generate_cluster(4, 8, 4, name="x")
    b = generate_cluster(4, 8, 4, name="x")
    assert [g.uuid for g in a.gpus()] == [g.uuid for g in b.gpus()]
    assert a.gpu_count == 32 and len(list(a.nodes())) == 8
    assert all(u.startswith("GPU-") for u in a.domains[0].uuids)


def test_with_states_shares_untouched_domains_and_rejects_unknown_gpus():
    c = generate_cluster(3, 4, 2)
    u = c.domains[1].gpus[0].uuid
    c2 = c.with_states({u: GpuState.FAILED})
    assert c2.domains[0] is c.domains[0] and c2.domains[2] is c.domains[2]
    assert c2.gpu(u).state is GpuState.FAILED and c.gpu(u).state is GpuState.HEALTHY
    assert c2.count_by_state()[GpuState.FAILED] == 1
    with pytest.raises(TopologyError, match="unknown GPU"):
        c.with_states({"GPU-nope": GpuState.FAILED})


def test_placeable_states():
    assert {s for s in GpuState if s.placeable} == {GpuState.HEALTHY, GpuState.SUSPECT}
    assert {s for s in GpuState if s.operator_state} == {
        GpuState.CORDONED, GpuState.DRAINING, GpuState.MAINTENANCE
    }


def test_duplicate_uuid_is_rejected():
    g = Gpu("GPU-1", "n", "d0", 0)
    with pytest.raises(TopologyError, match="duplicate GPU UUID"):
        Cluster.build("x", [Domain("d0", (g, g))])


def test_explicit_cluster_file_with_states():
    c = cluster_from_dict(
        {
            "name": "x",
            "domains": [
                {"id": "a", "power_budget_w": 5000, "nodes": [{"name": "n0", "gpus": ["GPU-a", "GPU-b"]}]},
                {"id": "b", "nodes": [{"name": "n1", "gpus": 2}]},
            ],
            "states": {"GPU-b": "cordoned"},
        }
    )
    assert c.gpu("GPU-b").state is GpuState.CORDONED
    assert c.domain("a").power_budget_w == 5000
    assert c.gpu_count == 4


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"name": "x"}, "give exactly one"),
        ({"generate": {"domains": 1, "domain_size": 4, "gpus_per_node": 4}, "states": {"GPU-x": "failed"}},
         "unknown GPU"),
        ({"generate": {"domains": 1, "domain_size": 4, "gpus_per_node": 4}, "states": {}, "extra": 1},
         "extra"),
        ({"generate": {"domains": 0, "domain_size": 4, "gpus_per_node": 4}}, "generate.domains"),
    ],
)
def test_bad_cluster_files(data, message):
    with pytest.raises(SpecError, match=message):
        cluster_from_dict(data)


def test_job_file_defaults_and_errors():
    j = job_from_dict({"name": "j", "tp": 4, "replicas": 2, "local_batch": 8, "heads": 8})
    assert j.groups_per_replica == 1 and j.scheme.value == "ntp"
    with pytest.raises(SpecError, match="scheme"):
        job_from_dict({"name": "j", "tp": 4, "replicas": 2, "local_batch": 8, "heads": 8, "scheme": "x"})
    assert j.balance == "layer"
    even = job_from_dict({"name": "j", "tp": 4, "replicas": 2, "local_batch": 8, "heads": 8, "balance": "stage"})
    assert even.work(3) == pytest.approx(4 / 3)  # proportional: T / t
    with pytest.raises(SpecError, match="balance"):
        job_from_dict({"name": "j", "tp": 4, "replicas": 2, "local_batch": 8, "heads": 8, "balance": "even"})
