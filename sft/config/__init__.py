"""Configuration: the flags' dataclasses and YAML (parsing starts nothing), DeepSpeed / FSDP / JSON config checks,
--bf16 auto."""
