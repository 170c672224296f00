"""Data preparation: sources, records, chat rendering + labels, samples, eval split, shards, the dataset store,
packing + collators."""
