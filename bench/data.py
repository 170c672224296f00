#!/usr/bin/env python
"""Data preparation at scale (a benchmark, not a test): wall time, conversations/s and peak RSS per rank.

Writes N conversations (the example's chitchat repeated, every copy with its own id) as JSONL into a
temporary folder, then prepares them as training does (stream + validate + tokenize + Arrow shards,
:func:`sft.data.store.dataset.build_dataset`) in these configurations (``--runs``):

* ``one``: 1 process; ``many``: P processes (``--processes``) on this host sharing one cache folder (ranks of one
  job: each prepares its shard, then waits for the others' completion markers and memory-maps all shards);
* ``hosts``: P network-namespace hosts x 1 process (``tests/helpers/netns.py``: needs root and \
``PYTHONPATH=.``), sharing one cache
  folder as a P-node job does: on each host the real launcher (``python -m sft.distributed.torchrun
  --nnodes P --node_rank i --nproc_per_node 1``, which sets RANK, WORLD_SIZE, LOCAL_RANK, GROUP_RANK) starts
  one rank that joins the process group (gloo, :func:`sft.distributed.process_group.init_process_group`), agrees
  with the others on the run and on the cache folder being shared (:func:`sft.data.store.shards.agree`, two collectives
  over the namespace bridge) and then prepares exactly as in training; its figures start after that agreement;
* ``plain``: the reference: one batched ``tokenizer()`` call on the same rendered texts (the first
  ``--plain_sample`` conversations), with 1 process and with P processes at once (each on its share of the
  texts, ``index % P``; the call starts in all of them together and the rate is the texts over the time from
  the first start to the last end): the best P processes could do when preparation were that call alone;
* ``before``: another checkout's ``sft`` (``--before REPO``, 1 process; a checkout from before the sharded
  preparation loads every record, then tokenizes on rank 0; a later one is run as this one);
* ``side``: ``--fast_model`` (a template on the fast path, ChatML) and ``--model`` (one on the per-turn path,
  Qwen3's) on the same data, 1 process each, in turn for ``--pairs`` pairs: each pair's per-token ratio and the median.

    .venv/bin/python bench/data.py --conversations 1000000 --processes 2 --runs plain many
    PYTHONPATH=. .venv/bin/python bench/data.py --conversations 20000 --runs plain one many hosts
    .venv/bin/python bench/data.py --conversations 200000 --before /path/to/old/checkout
    .venv/bin/python bench/data.py --conversations 300 --reasoning --runs side --model QWEN3 --fast_model CHATML

Every process runs in its own session with ``OMP_NUM_THREADS=1`` and ``TOKENIZERS_PARALLELISM=false`` (one core
each, so that 1 and P processes compare). Prints one line per configuration and rank and the machine's load
(``uptime``) before and after. Exit 2 with one line when a configuration cannot run here (``hosts`` without root).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_MODEL = os.path.join(HERE, ".cache", "example", "smollm2-135m-instruct")
DEFAULT_DATA = os.path.join(HERE, ".cache", "example", "chitchat.jsonl")

# One rank of the job; run as a separate process so that its peak RSS is its own.
_RANK = """
import json, os, resource, sys, time
rank, world, data, model, cache, run, max_len = sys.argv[1:8]
rank, world, max_len = int(rank), int(world), int(max_len)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
t0 = time.perf_counter()
api = sys.argv[8]
if api == "after":  # this layout: sft/ in folders by job, the preparation settings in one PreparationSpec
    from sft.model.loading import load_tokenizer
    from sft.data.spec import PreparationSpec
    try:  # the data wing in folders by stage
        from sft.data.store.dataset import build_dataset
        from sft.data.store.shards import JobView, ShardPlan
    except ImportError:  # before them: the wing's files side by side (sft/data/dataset.py, sft/data/shards.py)
        from sft.data.dataset import build_dataset
        from sft.data.shards import JobView, ShardPlan
    tok, eot, _ = load_tokenizer(model)
    view = JobView(rank=rank, world_size=world, local_rank=rank, local_world_size=world)
    plan = ShardPlan(view, run, True, [0] * world)
    t1 = time.perf_counter()
    spec = PreparationSpec(max_len, long_conversations=sys.argv[9], cache_dir=cache)
    ds, report = build_dataset([data], tok, eot, spec, plan=plan)
elif api == "flat":  # an sft with the sharded preparation in the flat sft/ (sft/shards.py)
    from sft.modeling import load_tokenizer
    from sft.dataset import build_dataset
    from sft.shards import JobView, Plan
    tok, eot, _ = load_tokenizer(model)
    plan = Plan(JobView(rank=rank, world_size=world, local_rank=rank, local_world_size=world), run, True, [0] * world)
    t1 = time.perf_counter()
    ds, report = build_dataset([data], tok, eot, max_len, None, cache, plan=plan, long_conversations=sys.argv[9])
else:  # an older sft: load every record, then build (rank 0 prepares)
    from sft.modeling import load_tokenizer
    from sft.dataset import build_dataset
    from sft.data import load_conversations
    tok, eot, _ = load_tokenizer(model)
    t1 = time.perf_counter()
    convs = load_conversations(data)
    ds, report = build_dataset(convs, data, tok, eot, max_len, None, cache)
t2 = time.perf_counter()
# VmHWM: this process's own peak. ru_maxrss is not: Linux carries it across exec, so a rank would report at least
# the RSS of the benchmark process it was forked from (which holds the plain tokenizer() sample).
try:
    peak = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:")) / 2**20
except (OSError, StopIteration):
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
try:  # outside the timed part: the tokens of the samples prepared
    tokens = sum(map(len, ds["input_ids"]))
except Exception:
    tokens = 0
print(json.dumps({"rank": rank, "samples": len(ds), "tokens": tokens, "startup_s": t1 - t0, "prepare_s": t2 - t1,
                  "peak_rss_gib": peak}))
"""


# One rank of a P-node job on its namespace host, started by torchrun (RANK, WORLD_SIZE, LOCAL_RANK, GROUP_RANK,
# MASTER_ADDR, MASTER_PORT set by it), as training reaches the data: process group, tokenizer, agree, prepare.
_HOST_RANK = """
import json, os, resource, socket, sys, time
data, model, cache, max_len, long_conversations = sys.argv[1:6]
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
t0 = time.perf_counter()
from sft.distributed.process_group import init_process_group
assert init_process_group("gloo", 600.0), "no process group: not started by torchrun?"
from sft.model.loading import load_tokenizer
tok, eot, _ = load_tokenizer(model)
from sft.data.store.dataset import build_dataset
from sft.data.store.shards import JobView, agree
from sft.data.spec import PreparationSpec
t1 = time.perf_counter()
plan = agree(cache, JobView.from_env())  # as sft.app.train.load_records: probe files + two collectives
t2 = time.perf_counter()
spec = PreparationSpec(int(max_len), long_conversations=long_conversations, cache_dir=cache)
ds, report = build_dataset([data], tok, eot, spec, plan=plan)
t3 = time.perf_counter()
peak = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:")) / 2**20
import torch.distributed as dist
dist.destroy_process_group()
print(json.dumps({"rank": int(os.environ["RANK"]), "node_rank": int(os.environ["GROUP_RANK"]),
                  "host": socket.gethostname(), "shared": plan.shared, "mine": plan.mine(int(os.environ["WORLD_SIZE"])),
                  "samples": len(ds), "startup_s": t1 - t0, "agree_s": t2 - t1, "prepare_s": t3 - t2,
                  "peak_rss_gib": peak}))
"""

# The plain reference, one of P processes: render its share of the sample (not timed), say so, wait for "go" on
# stdin, then one batched tokenizer() call. CLOCK_MONOTONIC (time.monotonic) is one clock for every process.
_PLAIN = """
import json, os, sys, time
model, data, sample, k, n = sys.argv[1:6]
sample, k, n = int(sample), int(k), int(n)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
from sft.data.records.records import RecordCheck, iter_conversations
from sft.model.loading import load_tokenizer
tok, _, _ = load_tokenizer(model)
head = data + f".plain-{k}-of-{n}.jsonl"
with open(data, encoding="utf-8") as f, open(head, "w", encoding="utf-8") as g:
    for i, line in zip(range(sample), f):
        if i % n == k:
            g.write(line)
texts = [tok.apply_chat_template(c.messages, tokenize=False) for c in iter_conversations(head, RecordCheck(head))]
os.remove(head)
print("ready", flush=True)
sys.stdin.readline()
t0 = time.monotonic()
tok(texts, add_special_tokens=False)
t1 = time.monotonic()
peak = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:")) / 2**20
print(json.dumps({"k": k, "texts": len(texts), "start": t0, "end": t1, "peak_rss_gib": peak}), flush=True)
"""

def write_data(src: str, n: int, out: str, reasoning: bool = False) -> None:
    """``n`` records of ``src`` repeated, each with its own id; ``reasoning``: every assistant turn also gets a
    ``reasoning_content`` (a sentence and the reply's first words), as a reasoning model's data has."""
    with open(src, encoding="utf-8") as f:
        base = [json.loads(line) for line in f if line.strip()]
    with open(out, "w", encoding="utf-8") as f:
        for i in range(n):
            rec = dict(base[i % len(base)])
            rec["id"] = f"{rec.get('id', 'c')}-{i}"
            if reasoning:
                form = "conversations" if "conversations" in rec else "messages"
                text = "value" if form == "conversations" else "content"
                rec[form] = [dict(t, reasoning_content=f"The user wrote something; I answer starting with "
                                  f"'{t[text][:40]}'.") if t.get("from", t.get("role")) in ("gpt", "assistant") else t
                             for t in rec[form]]
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")


def run_ranks(world: int, data: str, model: str, cache: str, max_len: int, mode: str, pythonpath: str,
              long_conversations: str = "split") -> dict:
    env = _env(pythonpath)
    t0 = time.perf_counter()
    # cwd = the checkout measured: ``python -c`` puts the working directory first on the module path. Each rank
    # in its own session: with the kernel's autogroup scheduling (sched_autogroup_enabled) the processes of one
    # session share one CPU share, so on a machine shared with other work P ranks of one session get no more CPU
    # than one (measured: 0.98x); separate sessions get what separate jobs get, as ranks do on their own cores.
    procs = [subprocess.Popen([sys.executable, "-c", _RANK, str(r), str(world), data, model, cache, "bench",
                               str(max_len), mode, long_conversations], env=env, stdout=subprocess.PIPE, text=True,
                              cwd=pythonpath, start_new_session=True)
             for r in range(world)]
    outs = [p.communicate()[0] for p in procs]
    wall = time.perf_counter() - t0
    if any(p.returncode for p in procs):
        raise SystemExit(f"a rank failed: {[p.returncode for p in procs]}")
    ranks = [json.loads(o.strip().splitlines()[-1]) for o in outs]
    return {"wall_s": wall, "ranks": ranks}


def _env(pythonpath: str) -> dict:
    return dict(os.environ, PYTHONPATH=pythonpath, OMP_NUM_THREADS="1")


def run_plain(world: int, model: str, data: str, sample: int) -> dict:
    """The plain batched tokenizer() reference with ``world`` processes at once, each on the texts ``index %
    world == k`` of the first ``sample`` conversations. Returns ``{"rate": conversations/s over the time from the
    first call's start to the last one's end, "procs": [...]}``."""
    procs = [subprocess.Popen([sys.executable, "-c", _PLAIN, model, data, str(sample), str(k), str(world)],
                              env=_env(HERE), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=HERE,
                              start_new_session=True)
             for k in range(world)]
    try:
        for p in procs:  # every process has rendered its texts: start the calls together
            line = p.stdout.readline().strip()
            if line != "ready":
                raise SystemExit(f"a plain tokenizer() process failed before its call (exit {p.wait()})")
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        outs = [json.loads(p.communicate()[0].strip().splitlines()[-1]) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if any(p.returncode for p in procs):
        raise SystemExit(f"a plain tokenizer() process failed: {[p.returncode for p in procs]}")
    span = max(o["end"] for o in outs) - min(o["start"] for o in outs)
    return {"rate": sum(o["texts"] for o in outs) / span, "seconds": span, "procs": outs}


def run_hosts(n: int, data: str, model: str, cache: str, max_len: int, long_conversations: str, work: str) -> dict:
    """``n`` namespace hosts x 1 rank preparing into one ``cache`` (see the module docstring). Returns ``{"wall_s",
    "ranks": [...]}`` with each rank's figures; the namespaces and every process in them are removed at the end.

    Raises:
        SystemExit: a rank failed (its exit code and the last lines of its log)."""
    from tests.helpers import netns  # the namespace hosts of the cluster tests (PYTHONPATH=., checked in main)

    script = os.path.join(work, "host_rank.py")
    with open(script, "w") as f:
        f.write(_HOST_RANK)
    hosts = netns.Hosts(n, tag="bd")
    logs = [open(os.path.join(work, f"host{i}.log"), "w+") for i in range(n)]
    procs = []
    try:
        t0 = time.perf_counter()
        for i in range(n):
            # what finetune/launch.sh runs on node i (static rendezvous on node 0), one process per node
            argv = [sys.executable, "-m", "sft.distributed.torchrun", "--nproc_per_node", "1", "--nnodes", str(n),
                    "--node_rank", str(i), "--master_addr", hosts.addrs[0], "--master_port", "29511",
                    script, data, model, cache, str(max_len), long_conversations]
            env = dict(_env(HERE), GLOO_SOCKET_IFNAME="eth0", TORCH_CPP_LOG_LEVEL="ERROR")
            procs.append(subprocess.Popen(hosts.cmd(i, argv), env=env, stdout=subprocess.PIPE, stderr=logs[i],
                                          text=True, cwd=HERE, start_new_session=True))
        outs = [p.communicate(timeout=7200)[0] for p in procs]
        wall = time.perf_counter() - t0
        bad = [(i, p.returncode) for i, p in enumerate(procs) if p.returncode]
        if bad:
            tails = "; ".join(f"host {i} exit {rc}: " + " | ".join(open(logs[i].name).read().strip().splitlines()[-3:])
                              for i, rc in bad)
            raise SystemExit(f"a host's rank failed: {tails}")
        ranks = sorted((json.loads(o.strip().splitlines()[-1]) for o in outs), key=lambda x: x["rank"])
        return {"wall_s": wall, "ranks": ranks}
    finally:
        netns.kill_groups(procs)
        for f in logs:
            f.close()
        hosts.close()


def side_by_side(a, data: str, work: str) -> None:
    """``--runs side``: ``--pairs`` pairs of 1-process preparations of the same data, ``--fast_model`` (the fast path)
    then ``--model`` (the per-turn path), each pair within the same minutes; prints each run's tokens/s and each
    pair's ratio per token (per-turn / fast), then the median ratio."""
    ratios = []
    for k in range(a.pairs):
        rates = {}
        for name, model in (("fast", a.fast_model), ("per-turn", a.model)):
            cache = os.path.join(work, f"cache-side-{name}-{k}")
            r = run_ranks(1, data, model, cache, a.max_length, "after", HERE, a.long_conversations)["ranks"][0]
            rates[name] = r["tokens"] / max(r["prepare_s"], 1e-9)
            print(f"side pair {k + 1}, {name} path ({model}): {r['prepare_s']:.1f} s preparing, samples "
                  f"{r['samples']}, {r['tokens']} tokens, {rates[name]:.0f} tokens/s; load {uptime()}", flush=True)
            shutil.rmtree(cache, ignore_errors=True)
        ratios.append(rates["per-turn"] / rates["fast"])
        print(f"side pair {k + 1}: per-turn path at {100 * ratios[-1]:.0f}% of the fast path per token", flush=True)
    ratios.sort()
    print(f"side: median {100 * ratios[len(ratios) // 2]:.0f}% of the fast path per token over {len(ratios)} pairs "
          f"(range {100 * ratios[0]:.0f}% to {100 * ratios[-1]:.0f}%)", flush=True)


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return "uptime: not available"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--conversations", type=int, default=1_000_000)
    ap.add_argument("--processes", type=int, default=2,
                    help="P: ranks of the 'many' run, hosts of the 'hosts' run, processes of the P-process plain call")
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--data", default=DEFAULT_DATA, help="conversations to repeat")
    ap.add_argument("--max_length", type=int, default=512)
    ap.add_argument("--long_conversations", choices=["split", "truncate"], default="split",
                    help="as the training flag (the 'before' checkout always truncates)")
    ap.add_argument("--plain_sample", type=int, default=20000, help="conversations for the plain tokenizer() figure")
    ap.add_argument("--reasoning", action="store_true",
                    help="give every reply a reasoning_content (the per-turn path; pair with a Qwen3-template --model)")
    ap.add_argument("--before", default=None, help="a checkout whose sft is measured too (1 process)")
    ap.add_argument("--runs", nargs="+", default=["plain", "one", "many", "before"],
                    choices=["plain", "one", "many", "hosts", "before", "side"],
                    help="plain: the tokenizer() reference with 1 and P processes; one: 1 process; many: P processes; "
                         "hosts: P namespace hosts x 1 process (root); before: --before's sft, 1 process; side: "
                         "--fast_model and --model in turn, 1 process (--pairs)")
    ap.add_argument("--fast_model", default=None,
                    help="with 'side' in --runs: a model whose template takes the fast path (ChatML), prepared side by "
                         "side with --model (the per-turn path, e.g. Qwen3's template) on the same data")
    ap.add_argument("--pairs", type=int, default=3, help="'side': fast, per-turn pairs run in turn (default 3)")
    ap.add_argument("--work", default=None, help="folder for data and caches (default: a new temporary one, removed)")
    a = ap.parse_args()
    if "side" in a.runs and not a.fast_model:
        print("bench/data.py: --runs side compares --fast_model with --model: pass --fast_model", file=sys.stderr)
        return 2
    for flag, path in (("--model", a.model), ("--data", a.data)) + ((("--fast_model", a.fast_model),)
                                                                    if a.fast_model else ()):
        if not os.path.exists(path):
            print(f"bench/data.py: {flag} {path}: not found; build the example with scripts/run_example.sh or pass "
                  f"{flag}", file=sys.stderr)
            return 2
    if "hosts" in a.runs:
        try:
            from tests.helpers import netns
        except ImportError:
            print("bench/data.py: --runs hosts uses the namespace hosts of tests/helpers/netns.py: run it from the "
                  "repository root with PYTHONPATH=.", file=sys.stderr)
            return 2
        why = netns.unavailable()
        if why:
            print(f"bench/data.py: --runs hosts cannot make namespace hosts here: {why}; run as root, or leave "
                  "'hosts' out of --runs", file=sys.stderr)
            return 2
    work = a.work or tempfile.mkdtemp(prefix="sft-bench-data-")
    try:
        print(f"load before: {uptime()}", flush=True)
        data = os.path.join(work, "data.jsonl")
        t0 = time.perf_counter()
        write_data(a.data, a.conversations, data, a.reasoning)
        print(f"wrote {a.conversations} conversations ({os.path.getsize(data) / 2**20:.0f} MiB) in "
              f"{time.perf_counter() - t0:.0f} s", flush=True)
        plain: dict[int, float] = {}
        if "plain" in a.runs:
            sample = min(a.plain_sample, a.conversations)
            for world in sorted({1, a.processes}):
                r = run_plain(world, a.model, data, sample)
                plain[world] = r["rate"]
                each = ", ".join(f"{o['texts']} texts in {o['end'] - o['start']:.1f} s" for o in r["procs"])
                speed = f", {r['rate'] / plain[1]:.2f}x one process" if world > 1 else ""
                print(f"plain batched tokenizer() on rendered texts, {world} process(es) at once: {r['rate']:.0f} "
                      f"conversations/s{speed} ({each}); at that rate 1,000,000 conversations take "
                      f"{1e6 / r['rate'] / 60:.1f} min", flush=True)
        configs = [c for run, c in (("one", ("after", 1, HERE)), ("many", ("after", a.processes, HERE)),
                                    ("hosts", ("hosts", a.processes, HERE)), ("before", ("before", 1, a.before)))
                   if run in a.runs and c[2]]
        single, samples = None, {}
        for mode, world, repo in configs:
            cache = os.path.join(work, f"cache-{mode}-{world}")
            if mode == "hosts":
                r = run_hosts(world, data, a.model, cache, a.max_length, a.long_conversations, work)
            else:
                # the API of the checkout: this layout, the flat sft/ with the sharded preparation, or older
                api = ("after" if mode == "after" or os.path.exists(os.path.join(repo, "sft", "data", "spec.py")) else
                       "flat" if os.path.exists(os.path.join(repo, "sft", "shards.py")) else "before")
                r = run_ranks(world, data, a.model, cache, a.max_length, api, repo, a.long_conversations)
            prep = max(x["prepare_s"] for x in r["ranks"])  # until every rank has every shard mapped
            rate = a.conversations / prep
            single = rate if (mode, world) == ("after", 1) else single
            samples[(mode, world)] = r["ranks"][0]["samples"]
            extra = f"; {100 * rate / plain[world]:.0f}% of plain tokenizer() with {world}" if world in plain else ""
            if world > 1 and mode != "before" and single:
                extra += f"; {rate / single:.2f}x one process"
            if mode == "hosts":
                what = f"hosts, {world} namespace hosts x 1 process, shared cache"
                ranks = "; ".join(f"rank {x['rank']} (node {x['node_rank']}, {x['host']}): shards {x['mine']}, "
                                  f"agree {x['agree_s']:.1f} s, preparing {x['prepare_s']:.0f} s, peak RSS "
                                  f"{x['peak_rss_gib']:.2f} GiB, cache seen as shared: {x['shared']}"
                                  for x in r["ranks"])
            else:
                what = f"{mode} ({repo}), {world} process(es)"
                ranks = "; ".join(f"rank {x['rank']}: preparing {x['prepare_s']:.0f} s, peak RSS "
                                  f"{x['peak_rss_gib']:.2f} GiB" for x in r["ranks"])
            print(f"{what}: {prep:.1f} s preparing ({r['wall_s']:.0f} s with start-up), {rate:.0f} conversations/s"
                  f"{extra}; samples {r['ranks'][0]['samples']}, {r['ranks'][0].get('tokens', 0)} tokens "
                  f"({r['ranks'][0].get('tokens', 0) / max(prep, 1e-9):.0f} tokens/s); {ranks}", flush=True)
            shutil.rmtree(cache, ignore_errors=True)
        if "side" in a.runs and a.fast_model:
            side_by_side(a, data, work)
        mine = {k: v for k, v in samples.items() if k[0] != "before"}
        if len(set(mine.values())) > 1:
            print(f"MISMATCH: the configurations made different numbers of samples: {mine}", flush=True)
            return 1
        print(f"load after: {uptime()}", flush=True)
    finally:
        if not a.work:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
