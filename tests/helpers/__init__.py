"""Code shared by the tests (no tests here): ``paths`` (ROOT, PYTHONPATH for subprocesses), ``data`` (TOY
records, write_jsonl), ``ports``, ``assets`` (tiny models), ``netns``, ``cluster_fakes``, ``ray_cluster``, and
``dist_worker`` (a program run under torchrun, not imported by tests except for its PROBE)."""
