"""Fast tests of the multi-node contract (sft/distributed/: contract, rendezvous, fingerprints, failures), in process.

Everything here stays on this machine: rendezvous tests use 127.0.0.1 (one thread per node). The launcher,
torchrun and the SLURM/PBS scripts' node/rank logic are in tests/integration/distributed/test_multinode_contract.py; the
real cross-host runs in tests/cluster/test_multinode.py.
"""
from __future__ import annotations

import socket
import threading
import time

import pytest

from sft.distributed.contract import (
    Contract,
    choose_interface,
    read_contract,
    route_source,
    scheduler_nnodes,
    start_line,
)
from sft.distributed.failures import explain_collective_failure
from sft.distributed.fingerprints import compare_fingerprints, input_fingerprint
from sft.distributed.rendezvous import node_rendezvous
from sft.errors import ContractError, PreflightError
from tests.helpers.ports import free_port

# ------------------------------------------------------------------------------------------------ the contract

def test_defaults():
    c = read_contract({})
    assert (c.nnodes, c.node_rank, c.master_addr, c.master_port, c.nproc_per_node, c.world_size, c.backend,
            c.rdzv_timeout) == (1, 0, "localhost", 6001, 1, 1, "gloo", 600)
    g = read_contract({}, gpus=4)
    assert (g.nproc_per_node, g.world_size, g.backend, g.device) == (4, 4, "nccl", "cuda")


@pytest.mark.parametrize("env,fragment", [
    ({"NNODES": "2", "NODE_RANK": "2"}, "NODE_RANK=2: must be in [0, NNODES=2)"),
    ({"NNODES": "0"}, "NNODES=0: must be a whole number >= 1"),
    ({"NNODES": "010"}, "NNODES=010"),
    ({"MASTER_PORT": "0"}, "MASTER_PORT=0: must be in 1-65535"),
    ({"MASTER_PORT": "65536"}, "MASTER_PORT=65536: must be in 1-65535"),
    ({"NPROC_PER_NODE": "0"}, "processes per node: must be a whole number >= 1"),
    ({"RDZV_TIMEOUT": "soon"}, "RDZV_TIMEOUT=soon"),
    ({"NNODES": "2", "MASTER_ADDR": "localhost"}, "MASTER_ADDR=localhost: a loopback address"),
    ({"NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "127.0.0.5"}, "MASTER_ADDR=127.0.0.5: a loopback address"),
    # 192.0.2.0/24 is TEST-NET-1 (RFC 5737): never a local address; nothing is sent (bind only)
    ({"NNODES": "2", "NODE_RANK": "0", "MASTER_ADDR": "192.0.2.7"},
     "is not an address of this host: node rank 0 must run on MASTER_ADDR"),
    ({"NNODES": "2", "MASTER_ADDR": "no-such-host.invalid"}, "MASTER_ADDR=no-such-host.invalid: does not resolve"),
])
def test_contract_errors(env, fragment):
    with pytest.raises(ContractError) as e:
        read_contract(env)
    assert fragment in str(e.value)


def test_every_problem_is_reported_at_once():
    with pytest.raises(ContractError) as e:
        read_contract({"NNODES": "x", "MASTER_PORT": "99999", "NPROC_PER_NODE": "-1"})
    assert len(e.value.problems) == 3 and "3 problems" in str(e.value)


def test_more_gpus_than_visible():
    with pytest.raises(ContractError, match="GPUS_PER_NODE=8: only 2 GPU"):
        read_contract({"GPUS_PER_NODE": "8"}, gpus=2)


def test_non_master_on_the_masters_host():
    own = route_source("192.0.2.7", 9)  # the address this host would use on its default route (no packet sent)
    if own is None or own.startswith("127."):
        pytest.skip("this machine has no non-loopback IPv4 address")
    with pytest.raises(ContractError, match=f"NODE_RANK=1, but MASTER_ADDR={own} is this host"):
        read_contract({"NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": own})
    assert read_contract({"NNODES": "2", "NODE_RANK": "0", "MASTER_ADDR": own}).node_rank == 0


def test_gloo_interface_must_exist():
    c = read_contract({})
    with pytest.raises(ContractError, match="GLOO_SOCKET_IFNAME=nosuch0: no interface nosuch0"):
        choose_interface(c, {"GLOO_SOCKET_IFNAME": "nosuch0"})
    assert choose_interface(c, {"GLOO_SOCKET_IFNAME": "lo"})[0] == "lo (GLOO_SOCKET_IFNAME)"


# ------------------------------------------------------------------------------------ the node rendezvous (loopback)

def contract(rank, n, port, timeout=5, **kw):
    fields = dict(nnodes=n, node_rank=rank, master_addr="127.0.0.1", master_port=port, nproc_per_node=1,
                  device="cpu", rdzv_timeout=timeout)
    fields.update(kw)
    return Contract(**fields)


def run_nodes(contracts):
    """node_rendezvous for each contract in its own thread; returns (error or None per node, seconds)."""
    errors = [None] * len(contracts)

    def one(i):
        try:
            node_rendezvous(contracts[i], log=lambda m: None)
        except PreflightError as e:
            errors[i] = str(e)

    t0 = time.monotonic()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(contracts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return errors, time.monotonic() - t0


def test_rendezvous_all_join_then_the_port_is_free_for_torchrun():
    port = free_port()
    errors, _ = run_nodes([contract(r, 3, port) for r in range(3)])
    assert errors == [None, None, None]
    with socket.socket() as s:  # torchrun binds the same port next (SO_REUSEADDR, as TCPStore does)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("", port))


def test_rendezvous_missing_node_ends_every_started_node_within_the_timeout():
    port = free_port()
    errors, seconds = run_nodes([contract(0, 3, port, timeout=2), contract(1, 3, port, timeout=2)])
    assert seconds < 10
    for e in errors:
        assert e and "only 2 of 3 nodes joined within RDZV_TIMEOUT=2 s" in e and "missing: node rank 2)" in e


def test_rendezvous_duplicate_node_rank():
    port = free_port()
    errors, _ = run_nodes([contract(0, 3, port), contract(1, 3, port), contract(1, 3, port)])
    assert all(e and "two nodes were started with NODE_RANK=1" in e for e in errors), errors


def test_rendezvous_disagreeing_nnodes_and_process_counts():
    port = free_port()
    errors, _ = run_nodes([contract(0, 2, port), contract(1, 3, port, nproc_per_node=2)])
    assert all(e and "started with NNODES=3, node rank 0 with NNODES=2" in e and "runs 2 process(es)" in e
               for e in errors), errors


def test_unreachable_master_is_reported_within_the_timeout():
    errors, seconds = run_nodes([contract(1, 2, free_port(), timeout=1)])
    assert seconds < 8
    assert "cannot reach the master at 127.0.0.1:" in errors[0] and "within RDZV_TIMEOUT=1 s" in errors[0]
    assert "Connection refused" in errors[0]


def test_master_port_in_use():
    with socket.socket() as s:
        s.bind(("", 0))
        s.listen(1)
        port = s.getsockname()[1]
        errors, _ = run_nodes([contract(0, 1, port)])
    assert "MASTER_PORT=%d is already in use on this node" % port in errors[0]


def test_something_else_on_the_master_port():
    with socket.socket() as s:  # accepts and closes without answering, like a foreign service
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        threading.Thread(target=lambda: s.accept()[0].close(), daemon=True).start()
        errors, _ = run_nodes([contract(1, 2, port, timeout=3)])
    assert "closed the connection without an answer" in errors[0]


# ------------------------------------------------------------------------------------ fingerprints, lost peers

def info(rank, node, host, **fp):
    base = {"--data_path file": "a" * 64, "model config (config.json)": "c" * 64, "sft version": "0.1.0"}
    base.update(fp)
    return {"rank": rank, "node_rank": node, "host": host, "addr": f"10.0.0.{node + 1}", "fp": base}


def test_fingerprints_name_the_differing_nodes():
    same = [info(0, 0, "a"), info(1, 0, "a"), info(2, 1, "b")]
    assert compare_fingerprints(same) == []
    bad = same + [info(3, 2, "c", **{"--data_path file": "f" * 64}), info(4, 3, "d", **{"sft version": "0.2.0"})]
    problems = compare_fingerprints(bad)
    assert len(problems) == 2
    assert problems[0] == ("--data_path file differs between nodes: node rank 0 (a), node rank 1 (b), "
                           "node rank 3 (d): aaaaaaaaaaaa...; node rank 2 (c): ffffffffffff...")
    bad[3]["where"] = {"--data_path file": "/other/d.jsonl"}
    assert "node rank 2 (c): ffffffffffff... (/other/d.jsonl)" in compare_fingerprints(bad)[0]
    assert "sft version differs between nodes" in problems[1] and "node rank 3 (d): 0.2.0" in problems[1]


def test_input_fingerprint_covers_data_config_and_tokenizer(tiny_model_dir, toy_data, tmp_path):
    import shutil

    fp = input_fingerprint(tiny_model_dir, {"--data_path": toy_data})
    assert set(fp) == {"--data_path file", "model config (config.json)", "tokenizer files", "sft version",
                       "world view"}
    copy = tmp_path / "model"
    shutil.copytree(tiny_model_dir, copy)
    assert input_fingerprint(str(copy), {"--data_path": toy_data})["tokenizer files"] == fp["tokenizer files"]
    with open(copy / "tokenizer_config.json", "a") as f:
        f.write("\n")
    assert input_fingerprint(str(copy), {"--data_path": toy_data})["tokenizer files"] != fp["tokenizer files"]


def test_lost_peer_is_named(monkeypatch):
    import torch.distributed as dist

    peers = {"10.213.0.3": {"node_rank": 2, "host": "node2", "ranks": [2]}}
    err = dist.DistBackendError("[../third_party/gloo/gloo/transport/tcp/pair.cc:538] Connection closed by peer "
                                "[10.213.0.3]:41234")
    msg = explain_collective_failure(err, 600, peers)
    assert msg.startswith("training stopped: another process of the job went away; the peer at 10.213.0.3 is node "
                          "rank 2 (node2, global rank(s) 2)")
    reset = explain_collective_failure(RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read "
                                                      "error [10.213.0.3]:49827: Connection reset by peer."), 600,
                                       peers)
    assert "the peer at 10.213.0.3 is node rank 2 (node2, global rank(s) 2)" in reset
    timeout = explain_collective_failure(RuntimeError("[gloo] Timed out waiting 3000ms for recv operation"), 3)
    assert "no answer within --ddp_timeout 3 s" in timeout
    assert explain_collective_failure(ValueError("unrelated")) is None


# ------------------------------------------------------------------------------------------------- elastic jobs

def _own_address():
    own = route_source("192.0.2.7", 9)  # the address this host would use on its default route (no packet sent)
    if own is None or own.startswith("127."):
        pytest.skip("this machine has no non-loopback IPv4 address")
    return own


def test_elastic_contract_maps_to_the_c10d_rendezvous():
    own = _own_address()
    c = read_contract({"NNODES": "2:3", "MASTER_ADDR": own, "SLURM_JOB_ID": "4711", "RDZV_TIMEOUT": "90"})
    assert (c.nnodes, c.elastic.min_nodes, c.elastic.max_restarts, c.elastic.rdzv_id, c.elastic.store_host) == \
        (3, 2, 3, "4711", True)
    assert c.elastic.rdzv_conf(c.rdzv_timeout) == \
        "join_timeout=90,last_call_timeout=3,keep_alive_interval=1,keep_alive_max_attempt=3,is_host=1"
    # NODE_RANK is the rendezvous' to give: a value that would be wrong for a static job is not an error here
    other = read_contract({"NNODES": "1:4", "NODE_RANK": "7", "MASTER_ADDR": "192.0.2.7", "MAX_RESTARTS": "0",
                           "RDZV_ID": "run-a", "RDZV_LAST_CALL_TIMEOUT": "20"})
    assert "last_call_timeout=20," in other.elastic.rdzv_conf(600)
    assert (other.elastic.store_host, other.elastic.max_restarts, other.elastic.rdzv_id) == (False, 0, "run-a")
    assert "elastic job run-a: 1 to 4 nodes" in start_line(other, "eth0") and "joins the rendezvous store" in \
        start_line(other, "eth0")


@pytest.mark.parametrize("env,fragment", [
    ({"NNODES": "3:2"}, "NNODES=3:2: an elastic job needs MIN:MAX"),
    ({"NNODES": "0:2"}, "NNODES=0:2: an elastic job needs MIN:MAX"),
    ({"NNODES": "2:"}, "NNODES=2:: an elastic job needs MIN:MAX"),
    ({"NNODES": "1:2", "MASTER_ADDR": "localhost"}, "MASTER_ADDR=localhost: a loopback address with NNODES=1:2"),
    ({"NNODES": "1:2", "MASTER_ADDR": "no-such-host.invalid"}, "MASTER_ADDR=no-such-host.invalid: does not resolve"),
    ({"NNODES": "1:2", "MASTER_ADDR": "192.0.2.7", "MAX_RESTARTS": "-1"}, "MAX_RESTARTS=-1: restarts"),
    ({"NNODES": "1:2", "MASTER_ADDR": "192.0.2.7", "RDZV_ID": "a b"}, "RDZV_ID=a b: 1-64 letters"),
    ({"NNODES": "1:2", "MASTER_ADDR": "192.0.2.7", "RDZV_LAST_CALL_TIMEOUT": "x"}, "RDZV_LAST_CALL_TIMEOUT=x: seconds"),
])
def test_elastic_contract_errors(env, fragment):
    with pytest.raises(ContractError) as e:
        read_contract(env)
    assert fragment in str(e.value)


@pytest.mark.parametrize("env,nnodes", [
    ({}, "3"),
    ({"NNODES": "5"}, "3"),  # a plain NNODES: the allocation wins, as before elastic jobs
    ({"MIN_NODES": "2"}, "2:3"),
    ({"MIN_NODES": "3"}, "3:3"),  # restarts in place, no node to lose
    ({"NNODES": "1:3"}, "1:3"),
    ({"MIN_NODES": "2", "NNODES": "2:3"}, "2:3"),
    ({"MIN_NODES": "", "NNODES": ""}, "3"),
])
def test_scheduler_nnodes_for_a_job_of_three_nodes(env, nnodes):
    assert scheduler_nnodes(env, 3, "SLURM_NNODES=3") == nnodes


@pytest.mark.parametrize("env,problem", [
    ({"MIN_NODES": "4"}, "MIN_NODES=4: the fewest nodes the elastic job goes on with must be a whole number in 1..3 "
                         "(this job has 3 node(s): SLURM_NNODES=3), or submit the job with at least 4 nodes"),
    ({"MIN_NODES": "0"}, "MIN_NODES=0: the fewest nodes the elastic job goes on with must be a whole number in 1..3 "
                         "(this job has 3 node(s): SLURM_NNODES=3)"),
    ({"MIN_NODES": "two"}, "MIN_NODES=two: the fewest nodes"),
    ({"MIN_NODES": "02"}, "MIN_NODES=02: the fewest nodes"),
    ({"NNODES": "2:4"}, "NNODES=2:4: MAX must be the job's node count, 3 (SLURM_NNODES=3): give NNODES=2:3, or "
                        "MIN_NODES=2 alone"),
    ({"NNODES": "2:2"}, "NNODES=2:2: MAX must be the job's node count, 3"),
    ({"NNODES": "3:2"}, "NNODES=3:2: an elastic job needs MIN:MAX with whole numbers 1 <= MIN <= MAX; here MAX is the "
                        "job's 3 node(s) (SLURM_NNODES=3): give NNODES=MIN:3 or MIN_NODES=MIN"),
    ({"NNODES": ":3"}, "NNODES=:3: an elastic job needs MIN:MAX"),
    ({"MIN_NODES": "1", "NNODES": "2:3"},
     "MIN_NODES=1 and NNODES=2:3 ask for different minimums; set only one of them"),
])
def test_scheduler_nnodes_errors_name_the_variable_the_allocation_and_the_fix(env, problem):
    with pytest.raises(ContractError) as e:
        scheduler_nnodes(env, 3, "SLURM_NNODES=3")
    assert e.value.problems[0].startswith(problem) and len(e.value.problems) == 1, e.value.problems
    assert "\n" not in str(e.value)


def test_scheduler_nnodes_reports_every_problem_and_refuses_an_empty_job():
    with pytest.raises(ContractError) as e:
        scheduler_nnodes({"MIN_NODES": "9", "NNODES": "1:9"}, 2, "PBS_NODEFILE nf")
    assert [p.split(":")[0] for p in e.value.problems] == ["MIN_NODES=9", "NNODES=1"]
    with pytest.raises(ContractError, match="the job has 0 nodes"):
        scheduler_nnodes({"MIN_NODES": "1"}, 0, "PBS_NODEFILE nf")


def test_elastic_preflight_waits_for_the_store_then_reports_it_unreachable():
    from sft.distributed.contract import Elastic

    port = free_port()
    joiner = contract(0, 3, port, timeout=2, elastic=Elastic(2, 3, "t", store_host=False))
    errors, took = run_nodes([joiner])
    assert "cannot reach the elastic job's rendezvous store at 127.0.0.1:" in errors[0] and 1.5 < took < 10
    # once the store host's launcher listens, a joiner passes at once
    srv = socket.socket()
    srv.bind(("127.0.0.1", port))
    srv.listen(4)
    try:
        errors, took = run_nodes([joiner])
        assert errors == [None] and took < 2
    finally:
        srv.close()
    host = contract(0, 3, port, elastic=Elastic(2, 3, "t", store_host=True))
    assert run_nodes([host])[0] == [None]  # its check: MASTER_PORT is free for torchrun's store
