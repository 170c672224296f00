"""sft/distributed/collectives.py: no-ops without a process group and in a group of one; the real collectives in a
two-process gloo group (forked ranks: no second torch import), with the call sites that use them."""
import datetime
import json
import multiprocessing
import os
import types

import pytest
import torch
import torch.distributed as dist

from sft.distributed import collectives as c


def test_without_a_process_group_every_collective_returns_the_local_value():
    assert not dist.is_initialized()
    assert (c.initialized(), c.rank(), c.world_size(), c.backend()) == (False, 0, 1, None)
    c.barrier()
    obj = {"a": [1]}
    assert c.gather_objects(obj) == [obj] and c.gather_objects(obj)[0] is obj
    assert c.broadcast_object(obj, src=1) is obj
    assert c.any_rank(True) is True and c.any_rank(0) is False and c.all_ranks(2) is True and c.all_ranks(None) is False


def test_a_group_of_one_runs_no_collective(tmp_path, monkeypatch):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        for name in ("barrier", "all_gather_object", "broadcast_object_list", "all_reduce"):
            monkeypatch.setattr(dist, name, lambda *a, _n=name, **k: pytest.fail(f"{_n} called in a group of one"))
        assert (c.initialized(), c.rank(), c.world_size(), c.backend()) == (True, 0, 1, "gloo")
        c.barrier()
        assert c.gather_objects("x") == ["x"] and c.broadcast_object("x") == "x"
        assert c.any_rank(False) is False and c.all_ranks(True) is True
    finally:
        monkeypatch.undo()
        dist.destroy_process_group()


def _rank_main(rank: int, tmp: str) -> None:
    """One rank of the two-process group: every collective, then the call sites that use them; writes what it saw."""
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2")
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    try:
        from sft.config.precision import agree_across_ranks, agreed_bf16
        from sft.data.store.shards import JobView, agree
        from sft.train.preemption import PreemptionHandler

        seen = {"query": [c.initialized(), c.rank(), c.world_size(), c.backend()],
                "gather": c.gather_objects({"rank": rank}), "broadcast": c.broadcast_object(f"from {rank}", src=1),
                "any": [c.any_rank(rank == 1), c.any_rank(False)], "all": [c.all_ranks(rank == 1), c.all_ranks(True)]}
        c.barrier()
        seen["bf16"] = agree_across_ranks(rank == 0)  # one rank without fast bf16: neither uses it
        auto = (rank == 0, "auto", "r")  # this rank's choice under --bf16 auto, as parsed, and its reason
        seen["agreed"] = list(agreed_bf16(*auto))
        handler = PreemptionHandler()
        handler.signum = 15 if rank == 1 else None  # SIGTERM reached rank 1 only
        seen["stop"] = handler._agreed(types.SimpleNamespace(device=torch.device("cpu")))
        view = JobView.from_env()
        plan = agree(os.path.join(tmp, "cache"), view)
        seen["view"], seen["plan"] = [view.rank, view.world_size], [plan.run, plan.shared, plan.nodes]
    finally:
        dist.destroy_process_group()
    with open(os.path.join(tmp, f"rank{rank}.json"), "w") as f:
        json.dump(seen, f)


def test_two_gloo_ranks(tmp_path):
    os.makedirs(tmp_path / "cache")
    ctx = multiprocessing.get_context("fork")
    ranks = [ctx.Process(target=_rank_main, args=(r, str(tmp_path))) for r in range(2)]
    for p in ranks:
        p.start()
    for p in ranks:
        p.join(timeout=90)
    for p in ranks:
        if p.is_alive():
            p.kill()
    assert [p.exitcode for p in ranks] == [0, 0]
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r, s in enumerate(seen):
        assert s["query"] == [True, r, 2, "gloo"]
        assert s["gather"] == [{"rank": 0}, {"rank": 1}] and s["broadcast"] == "from 1"
        assert s["any"] == [True, False] and s["all"] == [False, True]
        assert s["bf16"] is False and s["stop"] is True and s["view"] == [r, 2]
        assert s["agreed"] == ([False, "r; another rank chose fp32"] if r == 0 else [False, "r"])
    assert seen[0]["plan"] == seen[1]["plan"] and seen[0]["plan"][1:] == [True, [0, 0]]
    assert len(seen[0]["plan"][0]) == 12 and os.listdir(tmp_path / "cache") == []  # rank 0's run id; probe removed
