"""Every record-validation error names file, record index, id, turn and the fix."""
import json

import pytest

from sft.data.records.records import load_conversations
from sft.errors import DataError
from tests.helpers.data import TOY, write_jsonl

U, A = {"from": "user", "value": "q"}, {"from": "assistant", "value": "a"}

BAD = {
    "unknown role": ({"id": "r1", "conversations": [{"from": "bot", "value": "x"}, A]},
                     ["record 0", "id='r1'", "turn 0", "unknown role 'bot'", "aliases"]),
    "missing key": ({"id": "r2", "conversations": [{"from": "user"}, A]}, ["id='r2'", "turn 0", "missing key 'value'"]),
    "missing conversations": ({"id": "r3", "text": "hi"}, ["id='r3'", "missing key 'conversations'"]),
    "not a string": ({"id": "r4", "conversations": [U, {"from": "assistant", "value": None}]},
                     ["turn 1", "'value' is null, not a string"]),
    "number value": ({"id": "r5", "messages": [{"role": "user", "content": 5}, {"role": "assistant", "content": "a"}]},
                     ["turn 0", "'content' is 5"]),
    "empty value": ({"id": "r6", "conversations": [U, {"from": "gpt", "value": "   "}]}, ["turn 1", "empty 'value'"]),
    "empty conversation": ({"id": "r7", "conversations": []}, ["id='r7'", "'conversations' is empty"]),
    "out of order": ({"id": "r8", "conversations": [U, U, A]}, ["turn 1", "roles out of order", "merge consecutive"]),
    "assistant first": ({"id": "r9", "conversations": [A, U, A]}, ["turn 0", "role assistant where user was expected"]),
    "late system": ({"id": "r10", "conversations": [U, A, {"from": "system", "value": "s"}, U, A]},
                    ["turn 2", "system turn after the first"]),
    "no assistant": ({"id": "r11", "conversations": [{"from": "system", "value": "s"}, U]}, ["no assistant turn"]),
    "trailing user": ({"id": "r12", "conversations": [U, A, U]}, ["turn 2", "last turn is from the user"]),
    "not an object": (["user", "hi"], ["record 0", "not an object"]),
    "both forms": ({"id": "r14", "conversations": [U, A], "messages": []}, ["both 'conversations' and 'messages'"]),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_each_validation_error(tmp_path, case):
    rec, fragments = BAD[case]
    path = write_jsonl(tmp_path / "d.jsonl", [rec])
    with pytest.raises(DataError) as e:
        load_conversations(path)
    msg = str(e.value)
    assert path in msg
    for frag in fragments:
        assert frag in msg, (frag, msg)
    assert "--on_bad_record skip" in msg


def test_all_problems_reported_at_once(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [TOY[0], BAD["unknown role"][0], BAD["no assistant"][0]])
    with pytest.raises(DataError) as e:
        load_conversations(path)
    assert "2 invalid record(s) of 3" in str(e.value) and "r1" in str(e.value) and "r11" in str(e.value)


def test_skip_drops_bad_records_and_reports(tmp_path, caplog):
    path = write_jsonl(tmp_path / "d.jsonl", [TOY[0], BAD["unknown role"][0], TOY[2], BAD["empty value"][0]])
    with caplog.at_level("WARNING"):
        convs = load_conversations(path, "skip")
    assert [c.id for c in convs] == ["add", "hi"]
    assert "skipped 2 invalid record(s)" in caplog.text and "r1" in caplog.text and "r6" in caplog.text


def test_json_list_bom_and_roles(tmp_path):
    p = tmp_path / "d.json"
    p.write_bytes(b"\xef\xbb\xbf" + json.dumps(TOY).encode("utf-8"))
    convs = load_conversations(str(p))
    assert len(convs) == len(TOY)
    assert convs[0].messages == [{"role": "user", "content": "What is 2+2?"},
                                 {"role": "assistant", "content": "2+2 is 4."}]
    assert convs[1].messages[0]["role"] == "system"


def test_missing_id_uses_index(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": [{"role": "user", "content": "q"},
                                                            {"role": "assistant", "content": "a"}]}])
    assert load_conversations(path)[0].id == "#0"


@pytest.mark.parametrize("name,content,fragment", [
    ("empty.jsonl", b"", "the file is empty"),
    ("blank.json", b"  \n\n", "the file is empty"),
    ("broken.json", b'[{"id": 1,', "not valid JSON"),
    ("dict.json", b'{"data": []}', "record 0: missing key 'conversations' (or 'messages')"),
    ("string.json", b'["just text"]', "record 0: the record is a JSON str, not an object"),
    ("number.json", b'42', "neither a JSON list nor JSONL"),
    ("utf16.json", '[{"id": 1}]'.encode("utf-16"), "the file is UTF-16"),
    ("empty_list.json", b"[]", "holds no records"),
    ("latin1.json", '[{"id": "é"}]'.encode("latin-1"), "not UTF-8"),
    ("jsonl_broken.jsonl", b'{"id": 1}\n{"id": \n', "line 2, column"),
    ("jsonl_latin1.jsonl", '{"id": "é", "messages": []}\n'.encode("latin-1"), "not UTF-8"),
])
def test_file_level_errors(tmp_path, name, content, fragment):
    p = tmp_path / name
    p.write_bytes(content)
    with pytest.raises(DataError, match=None) as e:
        load_conversations(str(p))
    assert fragment in str(e.value) and str(p) in str(e.value)


def test_directory_is_refused(tmp_path):
    with pytest.raises(DataError, match="is a directory"):
        load_conversations(str(tmp_path))


def test_skip_mode_drops_undecodable_jsonl_line(tmp_path):
    p = tmp_path / "d.jsonl"
    good = json.dumps(TOY[0]).encode()
    p.write_bytes(good + b"\n" + '{"id": "\xe9"}'.encode("latin-1") + b"\n" + json.dumps(TOY[2]).encode() + b"\n")
    assert [c.id for c in load_conversations(str(p), "skip")] == ["add", "hi"]


def test_format_is_decided_by_content_not_name(tmp_path):
    as_jsonl = tmp_path / "list.jsonl"  # a JSON list in a .jsonl file
    as_jsonl.write_text(json.dumps(TOY, indent=2))
    as_json = tmp_path / "lines.json"  # JSONL in a .json file
    as_json.write_text("\n".join(json.dumps(r) for r in TOY))
    single = tmp_path / "one.txt"  # one pretty-printed record
    single.write_text(json.dumps(TOY[0], indent=2))
    assert len(load_conversations(str(as_jsonl))) == len(TOY) == len(load_conversations(str(as_json)))
    assert [c.id for c in load_conversations(str(single))] == ["add"]


def test_duplicate_ids_are_reported(tmp_path, caplog):
    path = write_jsonl(tmp_path / "d.jsonl", [TOY[0], TOY[0]])
    with caplog.at_level("WARNING"):
        assert len(load_conversations(path)) == 2
    assert "1 id(s) appear more than once" in caplog.text and "'add'" in caplog.text
