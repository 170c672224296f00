"""Read the records of one data source as a stream: memory does not grow with the number of records.

A source is one of (the format is decided by the content or the folder, a compression suffix by the name):

* JSON: a list of records ``[{...}, {...}]`` (parsed incrementally, one record at a time) or one record ``{...}``;
* JSONL: one record per line;
* either of them compressed, where ``datasets`` reads it too (``.gz``, ``.bz2``, ``.xz``, ``.zst``, ``.lz4``:
  fsspec's codecs; ``.zst`` needs ``zstandard`` and ``.lz4`` needs ``lz4`` installed);
* Parquet (``.parquet``, or a file starting with the ``PAR1`` magic): read by row batches (pyarrow);
* a ``datasets.Dataset.save_to_disk`` folder (memory-mapped by ``datasets``).

:func:`iter_raw` yields ``(index, record)`` for the records of one shard (``index % n_shards == shard``) and a
:class:`~sft.data.records.records.Problem` for a JSONL line that cannot be read (so ``--on_bad_record skip`` can drop
it). Records are only parsed for the own shard where the format allows it (JSONL: other lines are only split off).
"""
from __future__ import annotations

import codecs
import json
import os
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Union

from sft.errors import DataError

COMPRESSED = {".gz": "gzip", ".bz2": "bz2", ".xz": "xz", ".zst": "zstd", ".lz4": "lz4"}
CHUNK = 1 << 20  # bytes read at a time from a JSON list (1 MiB)
ARROW_BATCH = 1024  # rows converted to Python at a time from Parquet / Arrow


@dataclass
class Problem:
    """One reason a record cannot be used, with where it is and how to fix it."""

    file: str
    index: Optional[int]  # 0-based record index (JSONL: counts non-blank lines)
    record_id: Optional[str]
    what: str
    fix: str
    turn: Optional[int] = None
    kind: str = "invalid"

    def __str__(self) -> str:
        where = [self.file]
        if self.index is not None:
            where.append(f"record {self.index}")
        if self.record_id is not None:
            where.append(f"id={self.record_id!r}")
        if self.turn is not None:
            where.append(f"turn {self.turn}")
        return f"{', '.join(where)}: {self.what}; {self.fix}"


def is_dataset_folder(path: str) -> bool:
    """A ``datasets.Dataset.save_to_disk`` folder (``state.json`` + ``dataset_info.json``)."""
    return os.path.isfile(os.path.join(path, "state.json")) and os.path.isfile(os.path.join(path, "dataset_info.json"))


def folder_problem(path: str) -> str:
    """Why a folder is not a usable source ("" when it is one)."""
    if os.path.isfile(os.path.join(path, "dataset_dict.json")):
        splits = sorted(d for d in os.listdir(path) if os.path.isdir(os.path.join(path, d)))
        return (f"is a datasets DatasetDict folder; give one split's folder "
                f"({', '.join(os.path.join(path, s) for s in splits)})")
    if not is_dataset_folder(path):
        return ("is a directory; give a .json, .jsonl (optionally .gz/.bz2/.xz/.zst) or .parquet file, "
                "or a folder written by datasets' save_to_disk")
    return ""


def _kind(path: str) -> str:
    if os.path.isdir(path):
        why = folder_problem(path)
        if why:
            raise DataError(f"{path}: {why}")
        return "arrow"
    if path.endswith(".parquet"):
        return "parquet"
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise DataError(f"{path}: cannot be read ({e.strerror}); check the path and permissions") from None
    return "parquet" if magic == b"PAR1" else "json"


def _open(path: str):
    ext = os.path.splitext(path)[1].lower()
    try:
        if ext in COMPRESSED:
            import fsspec

            return fsspec.open(path, "rb", compression=COMPRESSED[ext]).open()
        return open(path, "rb")
    except (OSError, ValueError, ImportError) as e:  # a missing codec package, permissions
        raise DataError(f"{path}: cannot be read ({getattr(e, 'strerror', None) or e}); check the path and "
                        "permissions (.zst needs the zstandard package, .lz4 the lz4 package)") from None


def iter_raw(path: str, shard: int = 0, n_shards: int = 1) -> Iterator[Union[tuple[int, Any], Problem]]:
    """Yield ``(index, record)`` (0-based record index; JSONL: counts non-blank lines) or a ``Problem`` for the
    records of shard ``shard`` of ``n_shards`` (``index % n_shards == shard``), in file order.

    Raises:
        DataError: a missing or unreadable file, a directory that is not a dataset folder, an empty file, one
            that is neither JSON nor JSONL, a syntax error or non-UTF-8 bytes in a JSON list, a wrong top-level
            type, a file that is not Parquet.
    """
    kind = _kind(path)
    if kind == "arrow":
        yield from _iter_arrow(path, shard, n_shards)
    elif kind == "parquet":
        yield from _iter_parquet(path, shard, n_shards)
    else:
        yield from _iter_json(path, shard, n_shards)


def _drop_nulls(rec: Any) -> Any:
    """Columnar formats give every row every column: a missing key reads as None; drop those keys (the record
    then reads as it would from JSONL), in the record and in its turns."""
    if not isinstance(rec, dict):
        return rec
    out = {k: v for k, v in rec.items() if v is not None}
    for key in ("conversations", "messages"):
        if isinstance(out.get(key), list):
            out[key] = [{k: v for k, v in t.items() if v is not None} if isinstance(t, dict) else t for t in out[key]]
    return out


def _iter_arrow(path: str, shard: int, n_shards: int):
    import datasets

    try:
        ds = datasets.load_from_disk(path)
    except Exception as e:  # noqa: BLE001 - datasets raises several kinds for a damaged folder
        raise DataError(f"{path}: cannot be loaded as a datasets folder ({str(e).splitlines()[0][:200]}); "
                        "write it with Dataset.save_to_disk") from None
    if len(ds) == 0:
        raise DataError(f"{path}: the dataset holds no records")
    mine = ds.select(range(shard, len(ds), n_shards))
    index = shard
    for batch in mine.iter(batch_size=ARROW_BATCH):
        for values in zip(*batch.values()):
            yield index, _drop_nulls(dict(zip(batch.keys(), values)))
            index += n_shards


def _iter_parquet(path: str, shard: int, n_shards: int):
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path}: not a readable Parquet file ({str(e)[:200]}); write it with pandas.to_parquet, "
                        "pyarrow.parquet.write_table or Dataset.to_parquet") from None
    if pf.metadata.num_rows == 0:
        raise DataError(f"{path}: the Parquet file holds no records")
    start = 0
    for batch in pf.iter_batches(batch_size=ARROW_BATCH):
        first = (shard - start) % n_shards
        own = list(range(first, batch.num_rows, n_shards))
        for i, rec in zip(own, batch.take(pa.array(own, type=pa.int64())).to_pylist() if own else []):
            yield start + i, _drop_nulls(rec)
        start += batch.num_rows


def _iter_json(path: str, shard: int, n_shards: int):
    f = _open(path)
    try:
        head = f.read(CHUNK)
        if head.startswith((b"\xff\xfe", b"\xfe\xff")):
            raise DataError(f"{path}: the file is UTF-16; re-save it as UTF-8 (e.g. iconv -f utf-16 -t utf-8)")
        if head.startswith(b"\xef\xbb\xbf"):
            head = head[3:]
        while head.isspace() or not head:  # skip leading blank space beyond the first chunk
            more = f.read(CHUNK)
            if not more:
                raise DataError(f"{path}: the file is empty; it must hold a JSON list of records or JSONL lines")
            head = head.lstrip() + more
        first = head.lstrip()[:1]
        if first == b"[":
            yield from _iter_json_list(path, f, head, shard, n_shards)
        elif first == b"{":
            lines = [x for x in head.split(b"\n", 64)[:64] if x.strip()]
            # JSONL: the first line is a whole object, or looks like one and some early line is one (a
            # pretty-printed object starts with a lone "{" and is reported with its own syntax error)
            if _parses(lines[0]) or (len(lines) > 1 and lines[0].strip().endswith(b"}")
                                     and any(_parses(x) for x in lines[:8])):
                yield from _iter_jsonl(path, f, head, shard, n_shards)
            else:  # one pretty-printed record: read it whole (it is one record)
                raw = head + f.read()
                text = _decode(path, raw)
                if shard == 0:
                    yield 0, _json_loads(path, text)
        else:
            raise DataError(f"{path}: does not start with '[' or '{{', so it is neither a JSON list nor JSONL; "
                            "write a JSON list of records or one JSON object per line")
    finally:
        f.close()


def _decode(path: str, raw: bytes, line_base: int = 1, byte_base: int = 0) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = line_base + raw.count(b"\n", 0, e.start)
        raise DataError(f"{path}: line {line} (byte {byte_base + e.start}): bytes that are not UTF-8 "
                        f"({raw[e.start:e.start + 4]!r}); re-save the file as UTF-8 "
                        "(e.g. iconv -f latin1 -t utf-8)") from None


def _json_loads(path: str, text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(f"{path}: line {e.lineno}, column {e.colno}: not valid JSON ({e.msg}); "
                        "fix the syntax") from None
    except RecursionError:
        raise DataError(f"{path}: JSON nested too deeply to read; "
                        "records are objects holding a list of turns") from None


def _parses(line: bytes) -> bool:
    try:
        json.loads(line.decode("utf-8"))
        return True
    except (UnicodeDecodeError, ValueError, RecursionError):
        return False


def _lines(f, head: bytes):
    """Lines of the stream (without the newline), starting with the bytes already read."""
    rest = b""
    chunk = head
    while chunk:
        parts = (rest + chunk).split(b"\n")
        rest = parts.pop()
        yield from parts
        chunk = f.read(CHUNK)
    if rest:
        yield rest


def _iter_jsonl(path, f, head, shard, n_shards):
    index = 0
    for lineno, line in enumerate(_lines(f, head), start=1):
        if not line.strip():
            continue
        if index % n_shards != shard:
            index += 1
            continue
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as e:
            yield Problem(path, index, None, f"line {lineno}: bytes that are not UTF-8 (at column {e.start + 1})",
                          "re-save the file as UTF-8", kind="not UTF-8")
            index += 1
            continue
        try:
            yield index, json.loads(text)
        except json.JSONDecodeError as e:
            yield Problem(path, index, None, f"line {lineno}, column {e.colno}: not valid JSON ({e.msg})",
                          "each line must be one complete JSON object", kind="bad JSON")
        except RecursionError:
            yield Problem(path, index, None, f"line {lineno}: JSON nested too deeply to read",
                          "a record is an object holding a list of turns", kind="bad JSON")
        index += 1


class _ListReader:
    """Text of a JSON list file read in chunks, with the line number of the first character kept."""

    def __init__(self, path, f, head):
        self.path, self.f = path, f
        self.decoder = codecs.getincrementaldecoder("utf-8")()
        self.buf, self.line_base, self.byte_base, self.eof = "", 1, 0, False
        self._feed(head)

    def _feed(self, raw: bytes) -> None:
        try:
            self.buf += self.decoder.decode(raw, final=not raw)
        except UnicodeDecodeError as e:
            line = self.line_base + self.buf.count("\n") + raw.count(b"\n", 0, e.start)
            raise DataError(f"{self.path}: line {line} (byte {self.byte_base + e.start}): bytes that are not UTF-8 "
                            f"({raw[e.start:e.start + 4]!r}); re-save the file as UTF-8 "
                            "(e.g. iconv -f latin1 -t utf-8)") from None
        self.byte_base += len(raw)

    def more(self) -> bool:
        if self.eof:
            return False
        raw = self.f.read(CHUNK)
        self.eof = not raw
        self._feed(raw)
        return not self.eof

    def drop(self, pos: int) -> None:
        self.line_base += self.buf.count("\n", 0, pos)
        self.buf = self.buf[pos:]

    def skip_space(self, pos: int) -> int:
        while True:
            while pos < len(self.buf) and self.buf[pos] in " \t\r\n":
                pos += 1
            if pos < len(self.buf) or not self.more():
                return pos

    def error(self, pos: int, msg: str):
        line = self.line_base + self.buf.count("\n", 0, pos)
        col = pos - (self.buf.rfind("\n", 0, pos) + 1) + 1
        if self.buf.count("\n", 0, pos) == 0 and self.line_base > 1:
            col = None
        where = f"line {line}, column {col}" if col else f"line {line}"
        return DataError(f"{self.path}: {where}: not valid JSON ({msg}); fix the syntax")


def _iter_json_list(path, f, head, shard, n_shards):
    r = _ListReader(path, f, head)
    decoder = json.JSONDecoder()
    pos = r.skip_space(0) + 1  # after "["
    index = 0
    while True:
        pos = r.skip_space(pos)
        if pos >= len(r.buf):
            raise r.error(pos, "Expecting ',' delimiter or ']'")
        if r.buf[pos] == "]":
            break
        if index > 0:
            if r.buf[pos] != ",":
                raise r.error(pos, "Expecting ',' delimiter")
            pos = r.skip_space(pos + 1)
        while True:
            try:
                rec, end = decoder.raw_decode(r.buf, pos)
            except json.JSONDecodeError as e:
                incomplete = e.pos >= len(r.buf) - 8 or e.msg.startswith("Unterminated string")
                if not (incomplete and r.more()):
                    raise r.error(e.pos, e.msg) from None
                continue
            except RecursionError:
                raise DataError(f"{path}: JSON nested too deeply to read; records are objects holding a list of "
                                "turns") from None
            # a number or literal that ends with the text read so far may go on in the next chunk
            if end >= len(r.buf) and not isinstance(rec, (dict, list)) and r.more():
                continue
            break
        if index % n_shards == shard:
            yield index, rec
        index += 1
        if end > CHUNK:
            r.drop(end)
            end = 0
        pos = end
    if index == 0:
        raise DataError(f"{path}: the list holds no records")
    pos = r.skip_space(pos + 1)
    if pos < len(r.buf):
        raise r.error(pos, "Extra data")
