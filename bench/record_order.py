"""What reading shards back in record order costs (sft.data.store.dataset.in_record_order): N samples written as W
shards (records ``index % W == k``, ``input_ids`` of L tokens each, Arrow files memory-mapped as the cache has them),
then the sort by the ``record`` column and 100k random reads through the index map, against the same reads of the shards
as they are. Prints seconds and the resident memory the index map adds (the map is 8 bytes per sample).

    .venv/bin/python bench/record_order.py [N=2000000] [W=8] [L=64]
"""
import os
import random
import resource
import sys
import tempfile
import time

import datasets
import numpy as np
import pyarrow as pa

from sft.data.store.dataset import in_record_order


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def main() -> None:
    n, w, length = (int(x) for x in (sys.argv[1:] + ["2000000", "8", "64"][len(sys.argv) - 1:])[:3])
    schema = pa.schema([("record", pa.int64()), ("input_ids", pa.list_(pa.int32()))])
    with tempfile.TemporaryDirectory() as d:
        parts = []
        for k in range(w):
            idx = np.arange(k, n, w)
            path = os.path.join(d, f"shard-{k}.arrow")
            with pa.OSFile(path, "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
                for lo in range(0, len(idx), 100_000):
                    rec = idx[lo:lo + 100_000]
                    flat = pa.array(np.repeat(rec.astype(np.int32), length))
                    offsets = pa.array(np.arange(0, (len(rec) + 1) * length, length, dtype=np.int32))
                    writer.write_batch(pa.RecordBatch.from_arrays(
                        [pa.array(rec), pa.ListArray.from_arrays(offsets, flat)], schema=schema))
            parts.append(datasets.Dataset.from_file(path))
        ds = datasets.concatenate_datasets(parts)
        before = rss_mib()
        t0 = time.perf_counter()
        ordered = in_record_order(ds)
        sort_s = time.perf_counter() - t0
        added = rss_mib() - before
        picks = [random.randrange(n) for _ in range(100_000)]
        t0 = time.perf_counter()
        for i in picks:
            ds[i]
        plain_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        for i in picks:
            ordered[i]
        mapped_s = time.perf_counter() - t0
        assert [ordered[i]["record"] for i in picks[:1000]] == picks[:1000]
    print(f"{n} samples in {w} shards, {length} tokens each: sort {sort_s:.2f} s, resident memory +{added:.0f} MiB "
          f"(index map {n * 8 / 2**20:.0f} MiB); 100k random reads {plain_s:.2f} s as written, {mapped_s:.2f} s "
          f"through the index map; peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")


if __name__ == "__main__":
    main()
