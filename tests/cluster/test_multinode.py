"""Multi-node runs across separate network hosts (Linux network namespaces joined by a private bridge).

Each node runs the real launcher in its own namespace (own address 10.213.0.x, own host name), by hand
with the env contract (the SLURM and PBS scripts under a real slurmctld/slurmd and sshd are in
tests/cluster/test_slurm.py, which shares this module's references; its PBS test is also the 3-node launch of the
ZeRO-2 LoRA preset by hand, over sshd, against one host). Losses and the saved adapter must equal a single-host run
with the same world size, global batch and seed. Faults end within their timeouts with a message naming the
problem. Traffic goes only to the namespaces made here; they are removed after each test (also on failure).

Needs root (CI runs as root); skipped with the reason otherwise.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import time

import pytest

from tests.helpers import netns
from tests.helpers.data import TOY, write_jsonl
from tests.helpers.launchers import without_check  # noqa: F401  (test_hangs.py and test_elastic.py import it here)
from tests.helpers.paths import ROOT

_WHY = netns.unavailable()
pytestmark = [pytest.mark.multinode, pytest.mark.skipif(_WHY is not None, reason=_WHY or "")]

# The preset every node runs: LoRA with DeepSpeed ZeRO-2 (SFT_MULTINODE_PRESET=finetune_lora_single_gpu.sh for DDP).
PRESET = os.path.join(ROOT, "finetune", os.environ.get("SFT_MULTINODE_PRESET", "finetune_lora_ds.sh"))

# Few steps of a tiny model; global batch = 1 (micro) x 1 (accumulation) x world size.
TRAIN = ["--max_steps", "3", "--lora_r", "4", "--per_device_train_batch_size", "1",
         "--gradient_accumulation_steps", "1", "--save_strategy", "no", "--disable_tqdm", "True", "--seed", "7"]
# Multi-node and single-host runs compare per-step losses within this absolute tolerance (trainer_state.json
# floats) and the saved adapter tensors within ATOL_WEIGHTS: the same samples meet the same gloo all-reduce,
# so in practice they are bitwise equal; the tolerance only absorbs summation-order noise.
ATOL_LOSS = 1e-5
ATOL_WEIGHTS = 1e-6
RUN_LIMIT_S = 300  # a whole job on a loaded 2-core machine; every fault must end well before


@pytest.fixture
def make_hosts():
    made = []

    def make(n: int) -> netns.Hosts:
        h = netns.Hosts(n, tag=f"t{len(made)}")
        made.append(h)
        return h

    yield make
    for h in made:
        h.close()
        assert not h.leftovers(), f"namespaces left behind: {h.leftovers()}"


def node_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "GPUS_PER_NODE", "PYTHON")}
    env.update({"OMP_NUM_THREADS": "1", "RDZV_TIMEOUT": "120"})
    env.update({k: str(v) for k, v in extra.items()})
    return env


class Job:
    """Processes started in namespaces, each with its own log file; all killed on close()."""

    def __init__(self, tmp_path):
        self.tmp, self.procs, self.logs, self.t0 = tmp_path, [], [], time.monotonic()

    def start(self, argv, env, name):
        log = self.tmp / f"{name}.log"
        self.logs.append(log)
        self.procs.append(subprocess.Popen(argv, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                                           cwd=str(self.tmp), start_new_session=True))
        return self.procs[-1]

    def wait(self, limit=RUN_LIMIT_S) -> list[int]:
        rcs = []
        for p in self.procs:
            try:
                rcs.append(p.wait(timeout=max(1.0, limit - (time.monotonic() - self.t0))))
            except subprocess.TimeoutExpired:
                self.close()
                pytest.fail(f"job still running after {limit} s:\n" + self.tails())
        return rcs

    def text(self, i) -> str:
        return self.logs[i].read_text(errors="replace")

    def tails(self) -> str:
        return "\n".join(f"--- {log.name}\n{log.read_text(errors='replace')[-2500:]}" for log in self.logs)

    def close(self):
        netns.kill_groups(self.procs)


@pytest.fixture
def job(tmp_path):
    j = Job(tmp_path)
    yield j
    j.close()


def start_by_hand(job, hosts, n, model, data, out, extra=(), ranks=None, master=None, envs=None, skip=(),
                  preset=PRESET, check=True):
    """Node i: NNODES=n NODE_RANK=ranks[i] MASTER_ADDR=... bash preset -m model -d data[i] ... in namespace i
    (``check=False``: without the launcher's ``sft check``, see :func:`without_check`)."""
    python = {} if check else {"PYTHON": without_check(job.tmp)}
    for i in range(n):
        if i in skip:
            continue
        settings = {"NNODES": n, "NODE_RANK": (ranks or list(range(n)))[i], "MASTER_ADDR": master or hosts.addrs[0],
                    "MASTER_PORT": 6001, **python, **(envs or {}).get(i, {})}
        env = node_env(**settings)
        d = data[i] if isinstance(data, list) else data
        argv = ["bash", preset, "-m", model, "-d", d, "--output_dir", str(out), *TRAIN, *extra]
        job.start(hosts.cmd(i, argv), env, f"node{i}")


def results(out):
    """Per-step losses (trainer_state.json) and the saved tensors of a finished run: the adapter, or the whole
    consolidated model of a full fine-tuning run."""
    from safetensors.torch import load_file

    state = json.load(open(os.path.join(out, "trainer_state.json")))
    losses = [h["loss"] for h in state["log_history"] if "loss" in h]
    saved = "adapter_model.safetensors" if os.path.isfile(os.path.join(out, "adapter_model.safetensors")) \
        else "model.safetensors"
    return losses, load_file(os.path.join(out, saved))


def assert_same_training(out, ref):
    import torch

    losses, weights = results(out)
    ref_losses, ref_weights = ref
    assert len(losses) == len(ref_losses) == 3
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= ATOL_LOSS, (losses, ref_losses)
    assert weights.keys() == ref_weights.keys()
    for k in weights:
        torch.testing.assert_close(weights[k], ref_weights[k], atol=ATOL_WEIGHTS, rtol=0)


_REFERENCE: dict[tuple[str, int], tuple] = {}


def reference(n, make_hosts, tmp_path_factory, tiny_model_dir, data, preset=PRESET):
    """One host, NPROC_PER_NODE=n processes (world size n), same flags: the losses multi-node must reproduce.

    Run once per test session: its output folder lies in the session's shared temporary folder (the parent of each
    pytest-xdist worker's), built under a file lock, so this file and tests/cluster/test_slurm.py, even in two
    workers, read the same run (its data: the TOY records, the same in every worker's ``data``)."""
    if (preset, n) not in _REFERENCE:
        import fcntl

        base = tmp_path_factory.getbasetemp()
        shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
        name = f"reference-{n}-{os.path.basename(preset).removesuffix('.sh')}"
        out, done = shared / name / "out", shared / name / "done"
        with open(shared / f"{name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also when the run fails
            if not done.exists():
                hosts = make_hosts(1)
                j = Job(tmp_path_factory.mktemp(f"ref{n}"))
                try:
                    j.start(hosts.cmd(0, ["bash", preset, "-m", tiny_model_dir, "-d", data, "--output_dir", str(out),
                                          *TRAIN]),
                            node_env(NPROC_PER_NODE=n, MASTER_ADDR="127.0.0.1", MASTER_PORT=6001,
                                     PYTHON=without_check(j.tmp)), "ref")
                    assert j.wait() == [0], j.tails()
                    assert f"world size {n}" in j.text(0)
                finally:
                    j.close()
                done.write_text("")
        _REFERENCE[preset, n] = results(out)
    return _REFERENCE[preset, n]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("data") / "toy.jsonl", TOY)


# ------------------------------------------------------------------------------------------------ launch paths

@pytest.mark.parametrize("preset_name,saved", [("finetune_lora_fsdp.sh", "adapter_model.safetensors"),
                                               ("finetune_fsdp.sh", "model.safetensors")], ids=["lora", "full"])
def test_fsdp2_by_hand_on_two_hosts_equals_one_host(preset_name, saved, make_hosts, job, tmp_path, tmp_path_factory,
                                                    tiny_model_dir, data):
    """finetune_lora_fsdp.sh (LoRA) and finetune_fsdp.sh (full fine-tuning), FSDP2 full shard over gloo, on 2
    namespace hosts, 1 process each: the same per-step losses and saved tensors (the adapter; every tensor of the
    consolidated model) as one host running 2 processes. The 2-host run goes through tests/helpers/dist_worker.py
    (trains and saves as finetune.py does) to record on each rank that fully_shard really sharded the model (DTensor
    parameters), i.e. that the run did not fall back to DDP."""
    preset = os.path.join(ROOT, "finetune", preset_name)
    ref = reference(2, make_hosts, tmp_path_factory, tiny_model_dir, data, preset=preset)
    hosts = make_hosts(2)
    out, report = tmp_path / "out", tmp_path / "report"  # both shared by the nodes, as on a shared filesystem
    report.mkdir()
    worker = {"SFT_PROGRAM": os.path.join(ROOT, "tests", "helpers", "dist_worker.py"),
              "SFT_TEST_REPORT_DIR": str(report), "PYTHONPATH": ROOT}
    start_by_hand(job, hosts, 2, tiny_model_dir, data, out, preset=preset, envs={0: worker, 1: worker}, check=False)
    assert job.wait() == [0, 0], job.tails()
    for i in range(2):  # by hand: MASTER_ADDR node rank 0's address, each node on its own host and address
        first = job.text(i).splitlines()[0]
        assert first.startswith(f"launch: node rank {i} of 2 nodes, 1 process(es) per node, world size 2, master "
                                f"{hosts.addrs[0]}:6001, interface eth0 {hosts.addrs[i]}"), job.tails()
        assert "backend gloo" in first, first
        rank = json.load(open(report / f"rank{i}.json"))
        assert rank["world_size"] == 2 and rank["fsdp"] and rank["fsdp2_sharded"] and not rank["deepspeed"], rank
    assert os.path.isfile(out / saved)
    assert_same_training(out, ref)


def test_sequence_parallel_inside_hosts_and_data_parallel_across(make_hosts, job, tmp_path, tiny_model_dir, data):
    """2 namespace hosts x 2 processes with --sequence_parallel_size 2 (LoRA, ZeRO-2 preset): each host's two
    processes share every micro batch's row (a group of consecutive ranks: inside a host), the two hosts read
    different micro batches (data parallel across). The same losses and adapter as one host running 2 processes
    without sequence parallelism: the data-parallel size is 2 both ways, so both read the same micro batches (LoRA
    dropout off: two processes cannot draw one process's masks)."""
    extra = ["--lora_dropout", "0"]
    hosts = make_hosts(2)
    ref_job = Job(tmp_path / "ref-logs")
    (tmp_path / "ref-logs").mkdir()
    try:
        ref_job.start(hosts.cmd(0, ["bash", PRESET, "-m", tiny_model_dir, "-d", data, "--output_dir",
                                    str(tmp_path / "ref"), *TRAIN, *extra]),
                      node_env(NPROC_PER_NODE=2, MASTER_ADDR="127.0.0.1", MASTER_PORT=6001,
                               PYTHON=without_check(tmp_path / "ref-logs")), "ref")
        assert ref_job.wait() == [0], ref_job.tails()
    finally:
        ref_job.close()
    out = tmp_path / "out"
    start_by_hand(job, hosts, 2, tiny_model_dir, data, out, extra=[*extra, "--sequence_parallel_size", "2"],
                  envs={0: {"NPROC_PER_NODE": 2}, 1: {"NPROC_PER_NODE": 2}}, check=False)
    assert job.wait() == [0, 0], job.tails()
    log = job.text(0)
    assert "world size 4" in log.splitlines()[0] and "data-parallel size 2 (world size 4 / sequence-parallel size 2)" \
        in log, job.tails()
    assert "span two nodes" not in log
    losses, weights = results(out)
    ref_losses, ref_weights = results(tmp_path / "ref")
    assert len(losses) == 3 and max(abs(a - b) for a, b in zip(losses, ref_losses)) <= ATOL_LOSS, (losses, ref_losses)
    import torch

    assert weights.keys() == ref_weights.keys()
    for k in weights:  # another summation order (attention over all-to-all, 4 ranks' all-reduce): fp32 noise only
        torch.testing.assert_close(weights[k], ref_weights[k], atol=1e-5, rtol=0)


# ------------------------------------------------------------------------------------------------------ faults

def test_node_that_never_starts(make_hosts, job, tmp_path, tiny_model_dir, data):
    hosts = make_hosts(3)
    start_by_hand(job, hosts, 3, tiny_model_dir, data, tmp_path / "out", skip={2},
                  envs={0: {"RDZV_TIMEOUT": 15}, 1: {"RDZV_TIMEOUT": 15}}, check=False)
    rcs = job.wait()
    elapsed = time.monotonic() - job.t0
    assert all(rc != 0 for rc in rcs), job.tails()
    for i in range(2):
        text = job.text(i)
        assert re.search(r"only [12] of 3 nodes joined within RDZV_TIMEOUT=15 s", text), job.tails()
        assert re.search(r"missing: node ranks? (1, )?2\b", text), text
    assert elapsed < RUN_LIMIT_S


def test_two_nodes_with_the_same_node_rank(make_hosts, job, tmp_path, tiny_model_dir, data):
    hosts = make_hosts(3)
    start_by_hand(job, hosts, 3, tiny_model_dir, data, tmp_path / "out", ranks=[0, 1, 1],
                  envs={i: {"RDZV_TIMEOUT": 60} for i in range(3)}, check=False)
    rcs = job.wait()
    assert rcs == [2, 2, 2], job.tails()
    for i in range(3):
        assert re.search(r"two nodes were started with NODE_RANK=1: node[12] \(10\.213\.0\.[23]\) and node[12] "
                         r"\(10\.213\.0\.[23]\)", job.text(i)), job.tails()


def test_wrong_master_addr(make_hosts, job, tmp_path, tiny_model_dir, data):
    hosts = make_hosts(2)
    # node 1 points at an address on the bridge that nobody has: connections time out
    start_by_hand(job, hosts, 2, tiny_model_dir, data, tmp_path / "out",
                  envs={0: {"RDZV_TIMEOUT": 10}, 1: {"RDZV_TIMEOUT": 10, "MASTER_ADDR": "10.213.0.99"}}, check=False)
    rcs = job.wait()
    assert rcs[0] != 0 and rcs[1] != 0, job.tails()
    assert "only 1 of 2 nodes joined within RDZV_TIMEOUT=10 s" in job.text(0) and "missing: node rank 1" in job.text(0)
    assert ("node rank 1: cannot reach the master at 10.213.0.99:6001 within RDZV_TIMEOUT=10 s" in job.text(1)
            and "MASTER_ADDR is node rank 0's address" in job.text(1)), job.tails()


def test_different_data_on_one_node(make_hosts, job, tmp_path, tiny_model_dir, data):
    hosts = make_hosts(2)
    other = write_jsonl(tmp_path / "toy-edited.jsonl", TOY[:-1])  # the same file, one record short
    start_by_hand(job, hosts, 2, tiny_model_dir, [data, other], tmp_path / "out", check=False)
    rcs = job.wait()
    assert rcs == [2, 2] or all(rc != 0 for rc in rcs), job.tails()
    text = job.text(0)
    assert "the nodes do not train on the same inputs" in text, job.tails()
    assert re.search(r"--data_path file differs between nodes: node rank 0 \(node0\): [0-9a-f]{12}\.\.\. "
                     r"\(\S+toy.jsonl\); "
                     r"node rank 1 \(node1\): [0-9a-f]{12}\.\.\. \(\S+toy-edited.jsonl\)", text), text
    assert "model config" not in text.split("the nodes do not train")[1].split("Copy the same")[0]  # only the data


def test_node_waits_for_a_slow_shard_longer_than_ddp_timeout(make_hosts, job, tmp_path, tiny_model_dir):
    """Node 0's shard (the even records) takes long to tokenize, node 1's is quick: node 1 waits on the shared
    cache's completion markers far longer than --ddp_timeout 5 s, and the job still trains."""
    long_turn = "many words in a long question " * 1500  # ~7,500 tokens, cut at --model_max_length
    rows = []
    for i in range(400):
        r = TOY[i % len(TOY)]
        if i % 2 == 0:
            r = {"id": f"long{i}", "messages": [{"role": "user", "content": "Hi"},
                                                 {"role": "assistant", "content": "Hello."},
                                                 {"role": "user", "content": long_turn},
                                                 {"role": "assistant", "content": "Ok."}]}
        rows.append(dict(r, id=f"{r['id']}-{i}"))
    slow = write_jsonl(tmp_path / "slow.jsonl", rows)
    hosts = make_hosts(2)
    start_by_hand(job, hosts, 2, tiny_model_dir, slow, tmp_path / "out",
                  extra=["--ddp_timeout", "5", "--data_cache_dir", str(tmp_path / "cache"),
                         "--model_max_length", "128"], check=False)
    assert job.wait() == [0, 0], job.tails()
    text = job.text(1)
    assert f"rank 1: waiting for shard(s) 0 of 2 of {slow} from node(s) 0 (rank(s) 0)" in text, job.tails()
    waited = float(re.search(r"rank 1: every shard of \S+ is ready after waiting (\d+) s", text).group(1))
    assert waited > 5, job.tails()
    assert "shared by every node" in job.text(0)
