"""Labels on a whole real corpus (over 5 s of tokenizing: out of the unit tier): every chitchat conversation with
the SmolLM2 tokenizer supervises exactly its replies. The rule and its small cases are in
tests/unit/data/test_chat.py."""
from sft.data.records.records import normalize_record
from tests.unit.data.test_chat import check


def test_chitchat_supervised_tokens_are_exactly_the_replies(smol_tok):
    """Real data: every two-speaker chitchat conversation, SmolLM2 tokenizer."""
    from scripts import prepare_example

    tok, eot = smol_tok
    for rec in prepare_example.chitchat_records():
        conv = normalize_record("chitchat", 0, rec)
        check(tok, eot, conv.messages)
