"""Prepared samples kept: Arrow shards over every rank, the cache key, the lazy dataset."""
