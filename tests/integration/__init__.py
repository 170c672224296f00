"""Integration tier: torchrun, DeepSpeed, training runs, resume/kill loops, the launchers and scripts as
subprocesses, the real example."""
