"""Damage a file on purpose (checkpoint-integrity tests)."""


def flip_byte(path, offset: int = 100) -> None:
    """Invert every bit of the byte at ``offset`` of ``path`` in place (the file keeps its size)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))
