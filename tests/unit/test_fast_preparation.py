"""The fast preparation path (one render per conversation, split samples cut from the conversation's own encoding)
gives exactly the ids and labels of the general path (two renders per conversation, every split sample encoded),
on real chitchat conversations with the real SmolLM2 tokenizer and the real Qwen vocabulary (ChatML fallback)."""
import pytest

from sft import chat, long_conversations
from sft.chat import IGNORE_INDEX, render_with_spans
from sft.data import normalize_record
from sft.samples import encode_samples

N_CONVERSATIONS, MAX_LEN = 200, 256  # at 256 tokens about half of them are split


@pytest.fixture(scope="module")
def chitchat_messages():
    from scripts import prepare_example

    return [normalize_record("chitchat", i, rec).messages
            for i, rec in enumerate(prepare_example.chitchat_records(N_CONVERSATIONS))]


def _general_path(monkeypatch):
    """Turn the fast path off: every conversation rendered as render_with_spans does, no sample cut from another."""
    monkeypatch.setattr(chat._Renderer, "render_all",
                        lambda self, convs: [render_with_spans(self.tokenizer, m) for m in convs])
    monkeypatch.setattr(long_conversations, "_cut_tokens", lambda tokenizer: frozenset())


@pytest.mark.parametrize("which", ["smol", "qwen"])
def test_fast_path_equals_general_path(which, smol_tok, qwen_tok, chitchat_messages, monkeypatch):
    tok, eot = smol_tok if which == "smol" else qwen_tok
    fast = {mode: encode_samples(tok, chitchat_messages, eot, MAX_LEN, None, mode) for mode in ("split", "truncate")}
    n_split = sum(len(samples) > 1 for samples in fast["split"])
    assert n_split > N_CONVERSATIONS // 4  # the split pieces are exercised, not only whole conversations
    with monkeypatch.context() as m:
        _general_path(m)
        general = {mode: encode_samples(tok, chitchat_messages, eot, MAX_LEN, None, mode)
                   for mode in ("split", "truncate")}
    for mode in ("split", "truncate"):
        assert fast[mode] == general[mode], mode
    # and both are what the docs promise: ids = apply_chat_template, every reply supervised in split mode
    ref = tok.apply_chat_template(chitchat_messages[0], tokenize=True, return_dict=False)
    assert fast["truncate"][0][0]["input_ids"] == list(ref)[:MAX_LEN]
    n_replies = sum(m["role"] == "assistant" for msgs in chitchat_messages for m in msgs)
    eot_labels = sum(ex["labels"].count(eot) for samples in fast["split"] for ex in samples)
    too_long_alone = sum(ex["truncated"] for samples in fast["split"] for ex in samples)  # cut before their end
    assert eot_labels + too_long_alone == n_replies
    assert all(any(x != IGNORE_INDEX for x in ex["labels"]) for samples in fast["split"] for ex in samples)


@pytest.mark.parametrize("cores,processes,env", [(2, 2, {"TOKENIZERS_PARALLELISM": "false"}),
                                                 (2, 1, {"RAYON_NUM_THREADS": "2"}),
                                                 (64, 8, {"RAYON_NUM_THREADS": "8"}),
                                                 (4, 8, {"TOKENIZERS_PARALLELISM": "false"})])
def test_tokenizer_threads_share_the_cores(cores, processes, env, monkeypatch):
    import os

    from sft.samples import limit_tokenizer_threads

    # a private copy of the environment: what the function sets goes away with the test
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items()
                                        if k not in ("TOKENIZERS_PARALLELISM", "RAYON_NUM_THREADS")})
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    limit_tokenizer_threads(processes)
    assert {k: os.environ.get(k) for k in env} == env
    assert len([k for k in ("TOKENIZERS_PARALLELISM", "RAYON_NUM_THREADS") if k in os.environ]) == 1


def test_tokenizer_threads_leave_the_users_choice(monkeypatch):
    import os

    from sft.samples import limit_tokenizer_threads

    monkeypatch.setattr(os, "environ", {**{k: v for k, v in os.environ.items() if k != "RAYON_NUM_THREADS"},
                                        "TOKENIZERS_PARALLELISM": "true"})
    limit_tokenizer_threads(16)
    assert os.environ["TOKENIZERS_PARALLELISM"] == "true" and "RAYON_NUM_THREADS" not in os.environ


def test_memoized_sandbox_renders_and_refuses_as_transformers(smol_tok, qwen_tok, chitchat_messages):
    """The chat template compiled with the memoized attribute check (sft.chat._compile_template) renders what
    apply_chat_template renders, and still refuses what the sandbox refuses, also when the answer comes from the memo
    (the second time)."""
    import jinja2
    from transformers.utils.chat_template_utils import _compile_jinja_template

    from sft.chat import _compile_template

    for tok, _eot in (smol_tok, qwen_tok):
        renderer = chat._Renderer.of(tok)
        assert renderer.compiled is not _compile_jinja_template(tok.chat_template)  # the memoized one is in use
        for m in chitchat_messages[:20]:
            assert renderer.render(m) == tok.apply_chat_template(m, tokenize=False)
    safe = _compile_template("{% for m in messages %}{{ loop.index }}{{ m.role.upper() }}{% endfor %}")
    assert safe.render(messages=[{"role": "user"}, {"role": "assistant"}]) == "1USER2ASSISTANT"
    # (template, refused): the sandbox raises for list mutation and dunder chains; an unsafe attribute printed on its
    # own is an empty undefined
    cases = [("{{ messages.append(1) }}", True), ("{{ messages.pop() }}", True), ("{{ ''.__class__.__mro__ }}", True),
             ("{{ loop_fn.__globals__ }}", False), ("{% for m in messages %}{{ loop.__init__ }}{% endfor %}", False)]

    def outcome(template):
        try:
            return "ok", template.render(messages=[1, 2], loop_fn=lambda: 0)
        except jinja2.exceptions.SecurityError as e:
            return "refused", str(e)

    for source, refused in cases:
        expected = outcome(_compile_jinja_template(source))
        assert expected[0] == ("refused" if refused else "ok") and (refused or expected[1] == ""), (source, expected)
        unsafe = _compile_template(source)
        assert [outcome(unsafe), outcome(unsafe)] == [expected, expected], source  # the second time the memo answers
