"""Several sources and formats train; under torchrun a rank waits for a slow shard past --ddp_timeout and trains."""
import gzip
import json
import os
import re
import subprocess
import sys

from sft.app.train import trainer_for
from sft.config.arguments import parse_args
from tests.helpers.data import TOY, write_jsonl
from tests.helpers.paths import ROOT, pythonpath_env
from tests.helpers.ports import free_port


def test_parquet_compressed_jsonl_and_alpaca_sources_train_together(tiny_model_dir, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([r for r in TOY if "messages" in r]), tmp_path / "chats.parquet")
    with gzip.open(tmp_path / "qwen.jsonl.gz", "wt", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in TOY if "conversations" in r)
    alpaca = write_jsonl(tmp_path / "alpaca.jsonl", [{"instruction": f"Repeat {i}", "input": "", "output": str(i)}
                                                     for i in range(4)])
    args = parse_args(["--model_name_or_path", tiny_model_dir, "--data_path", str(tmp_path / "chats.parquet"),
                       str(tmp_path / "qwen.jsonl.gz"), alpaca, "--output_dir", str(tmp_path / "out"),
                       "--data_cache_dir", str(tmp_path / "cache"), "--use_lora", "True", "--lora_r", "4",
                       "--max_steps", "2", "--per_device_train_batch_size", "2", "--report_to", "none",
                       "--save_strategy", "no", "--disable_tqdm", "True"])
    trainer, _, _ = trainer_for(*args)
    assert len(trainer.train_dataset) == len(TOY) + 4
    assert trainer.train().training_loss > 0
    assert len(os.listdir(tmp_path / "cache")) == 3  # one cache folder per source


def test_torchrun_rank_waits_for_a_slow_shard_past_ddp_timeout(tiny_model_dir, tmp_path):
    """Rank 0's shard (the even records) is slow to tokenize; rank 1 waits on the markers longer than
    --ddp_timeout 5 s (a collective would have died), then both train."""
    long_turn = "many words in a long question " * 1500
    rows = [dict(TOY[i % len(TOY)], id=f"r{i}") if i % 2 else
            {"id": f"long{i}", "messages": [{"role": "user", "content": long_turn},
                                            {"role": "assistant", "content": "Ok."}]}
            for i in range(800)]
    data = write_jsonl(tmp_path / "slow.jsonl", rows)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), os.path.join(ROOT, "finetune.py"),
           "--model_name_or_path", tiny_model_dir, "--data_path", data, "--output_dir", str(tmp_path / "out"),
           "--data_cache_dir", str(tmp_path / "cache"), "--ddp_timeout", "5", "--model_max_length", "128",
           "--use_lora", "True", "--lora_r", "4", "--max_steps", "1", "--report_to", "none", "--save_strategy", "no",
           "--disable_tqdm", "True"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=400,
                       env=pythonpath_env({**os.environ, "OMP_NUM_THREADS": "1"}))
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"rank 1: waiting for shard(s) 0 of 2 of {data} from node(s) 0 (rank(s) 0)" in r.stderr, r.stderr[-3000:]
    waited = float(re.search(r"rank 1: every shard of \S+ is ready after waiting (\d+) s", r.stderr).group(1))
    assert waited > 5
    assert os.path.isfile(tmp_path / "out" / "adapter_model.safetensors")
