"""The training loop's parts: the Trainer subclass and samplers, checkpoints + integrity + world-size resume,
preemption, metrics, the memory plan."""
