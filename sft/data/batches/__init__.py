"""Samples -> batches: packing and its collator, the sequence-parallel split."""
