"""The ONLY importer of private names of transformers / peft / DeepSpeed / accelerate / torch / Python's own modules:
one function per use, each naming the version it was checked against."""
