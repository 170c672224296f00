"""Cluster tier: nodes in separate network namespaces (multi-node runs, a real Ray cluster); root only, skipped
with the reason otherwise; marked ``cluster`` and ``multinode`` (``-m "not multinode"`` leaves them out)."""
