"""The real example's data conversion (scripts/prepare_example.py: chitchat-dataset conversations), in process.
The converted SmolLM2 model, a training run through the preset, merge and generation are in
tests/integration/app/test_example.py."""
from scripts import prepare_example


def test_chitchat_conversion_merges_speakers():
    recs = prepare_example.chitchat_records(50)
    assert len(recs) == 50
    for r in recs:
        roles = [t["from"] for t in r["conversations"]]
        assert roles[0] == "human" and roles[-1] == "gpt"
        assert all(a != b for a, b in zip(roles, roles[1:]))  # consecutive messages of a speaker were merged
