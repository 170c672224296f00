"""The fast preparation path (one render per conversation, split samples cut from the conversation's own encoding)
gives exactly the ids and labels of the general path (two renders per conversation, every split sample encoded),
on real chitchat conversations with the real SmolLM2 tokenizer and the real Qwen vocabulary (ChatML fallback)."""
import pytest

from sft.data.encode import long_conversations
from sft.data.encode.samples import encode_samples
from sft.data.records.records import normalize_record
from sft.data.spec import PreparationSpec
from sft.data.template import chat
from sft.data.template.chat import IGNORE_INDEX, render_with_spans

N_CONVERSATIONS, MAX_LEN = 200, 256  # at 256 tokens about half of them are split


@pytest.fixture(scope="module")
def chitchat_messages():
    from scripts import prepare_example

    return [normalize_record("chitchat", i, rec).messages
            for i, rec in enumerate(prepare_example.chitchat_records(N_CONVERSATIONS))]


def _general_path(monkeypatch):
    """Turn the fast path off: every conversation rendered as render_with_spans does, no sample cut from another."""
    monkeypatch.setattr(chat.Renderer, "render_all",
                        lambda self, convs: [render_with_spans(self.tokenizer, m) for m in convs])
    monkeypatch.setattr(long_conversations, "cut_tokens", lambda tokenizer: frozenset())
    monkeypatch.setattr(chat, "_labels_by_reply", lambda *args: None)  # labels token by token (the definition)


@pytest.mark.parametrize("which", ["smol", "qwen"])
def test_fast_path_equals_general_path(which, smol_tok, qwen_tok, chitchat_messages, monkeypatch):
    tok, eot = smol_tok if which == "smol" else qwen_tok
    fast = {mode: encode_samples(tok, chitchat_messages, eot, PreparationSpec(max_len=MAX_LEN, long_conversations=mode))
            for mode in ("split", "truncate")}
    n_split = sum(len(samples) > 1 for samples in fast["split"])
    assert n_split > N_CONVERSATIONS // 4  # the split pieces are exercised, not only whole conversations
    with monkeypatch.context() as m:
        _general_path(m)
        general = {mode: encode_samples(tok, chitchat_messages, eot,
                                        PreparationSpec(max_len=MAX_LEN, long_conversations=mode))
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


def _labels_or_error(f, ids, offsets, spans, eot):
    try:
        return f(ids, offsets, spans, eot)
    except chat.TemplateError as e:
        return f"TemplateError: {e}"


def test_labels_by_reply_equal_labels_by_token():
    """The binary-search labels equal the token-by-token definition on 20,000 random tokenizations: offsets that
    rise (with zero-width tokens, tokens sharing characters as byte-level pieces of one character do, tokens
    straddling a reply's edge, gaps), replies empty or at the end, missing end-of-turn tokens (the same
    TemplateError), and offsets that do not rise (then the definition itself answers)."""
    import random

    rng, eot, fast_used = random.Random(7), 9, 0
    for case in range(20000):
        n, pos, offsets = rng.randint(1, 40), 0, []
        for _ in range(n):
            kind = rng.random()
            if kind < 0.1:
                offsets.append((pos, pos))  # zero width
            elif kind < 0.2 and offsets:
                offsets.append(offsets[-1])  # the same characters again (a character split in bytes)
            else:
                pos += rng.randint(0, 2)
                end = max(pos + rng.randint(1, 4), offsets[-1][1] if offsets else 0)
                offsets.append((pos, end))
                pos = end if rng.random() < 0.7 else rng.randint(pos, end)  # sometimes overlap the next token
        if rng.random() < 0.05 and n > 2:
            i = rng.randrange(n - 1)
            offsets[i], offsets[i + 1] = offsets[i + 1], offsets[i]  # not rising (mostly)
        ids = [rng.choice([eot, 1, 2, 3]) for _ in range(n)]
        cuts = sorted(rng.randint(0, pos + 3) for _ in range(2 * rng.randint(0, 4)))
        spans = [(cuts[k], cuts[k + 1]) for k in range(0, len(cuts), 2)]
        fast = _labels_or_error(chat._labels_by_reply, ids, offsets, spans, eot) if spans else None
        if spans and all(offsets[i][0] <= offsets[i + 1][0] and offsets[i][1] <= offsets[i + 1][1]
                         for i in range(n - 1)):
            assert fast is not None, (ids, offsets, spans)  # rising offsets always take the fast path
        want = _labels_or_error(chat._labels_by_token, ids, offsets, spans, eot)
        got = _labels_or_error(chat.labels_from_spans, ids, offsets, spans, eot)
        assert got == want, (case, ids, offsets, spans)
        fast_used += fast is not None
    assert 10000 < fast_used < 18000  # both ways are exercised


@pytest.mark.parametrize("cores,processes,env", [(2, 2, {"TOKENIZERS_PARALLELISM": "false"}),
                                                 (2, 1, {"RAYON_NUM_THREADS": "2"}),
                                                 (64, 8, {"RAYON_NUM_THREADS": "8"}),
                                                 (4, 8, {"TOKENIZERS_PARALLELISM": "false"})])
def test_tokenizer_threads_share_the_cores(cores, processes, env, monkeypatch):
    import os

    from sft.data.encode.samples import limit_tokenizer_threads

    # a private copy of the environment: what the function sets goes away with the test
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items()
                                        if k not in ("TOKENIZERS_PARALLELISM", "RAYON_NUM_THREADS")})
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    limit_tokenizer_threads(processes)
    assert {k: os.environ.get(k) for k in env} == env
    assert len([k for k in ("TOKENIZERS_PARALLELISM", "RAYON_NUM_THREADS") if k in os.environ]) == 1


def test_tokenizer_threads_leave_the_users_choice(monkeypatch):
    import os

    from sft.data.encode.samples import limit_tokenizer_threads

    monkeypatch.setattr(os, "environ", {**{k: v for k, v in os.environ.items() if k != "RAYON_NUM_THREADS"},
                                        "TOKENIZERS_PARALLELISM": "true"})
    limit_tokenizer_threads(16)
    assert os.environ["TOKENIZERS_PARALLELISM"] == "true" and "RAYON_NUM_THREADS" not in os.environ


def test_memoized_sandbox_renders_and_refuses_as_transformers(smol_tok, qwen_tok, chitchat_messages):
    """The chat template compiled with the memoized attribute check (sft.compat.jinja.compile_template) renders
    what apply_chat_template renders, and still refuses what the sandbox refuses, also when the answer comes from the
    memo (the second time)."""
    import jinja2
    from transformers.utils.chat_template_utils import _compile_jinja_template

    from sft.compat.jinja import compile_template

    for tok, _eot in (smol_tok, qwen_tok):
        renderer = chat.Renderer.of(tok)
        assert renderer.compiled is not _compile_jinja_template(tok.chat_template)  # the memoized one is in use
        for m in chitchat_messages[:20]:
            assert renderer.render(m) == tok.apply_chat_template(m, tokenize=False)
    safe = compile_template("{% for m in messages %}{{ loop.index }}{{ m.role.upper() }}{% endfor %}")
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
        unsafe = compile_template(source)
        assert [outcome(unsafe), outcome(unsafe)] == [expected, expected], source  # the second time the memo answers
    # a namespace's attributes (read from its dict for scalars): the same values, undefined names and refusals
    ns = "{% set ns = namespace(i=1, s='a', n=none, l=[1], f=1.5, b=true) %}{% set ns.i = ns.i + 1 %}"
    for source in [ns + "{{ ns.i }}{{ ns.s }}{{ ns.n }}{{ ns.l }}{{ ns.f }}{{ ns.b }}{{ ns.missing }}",
                   ns + "{{ ns.s.upper() }}",
                   ns + "{{ ns._Namespace__attrs }}", ns + "{{ ns.__class__.__mro__ }}", ns + "{{ ns.s.format(1) }}",
                   "{% set ns = namespace(g=''.format) %}{{ ns.g('{0.__class__}', 1) }}"]:
        expected, ours = outcome(_compile_jinja_template(source)), compile_template(source)
        assert [outcome(ours), outcome(ours)] == [expected, expected], (source, expected)


_NOT_OPAQUE = [
    "{% for m in messages %}{{ m['content'] | trim }}{% endfor %}",  # rewrites content
    "{% for m in messages %}{% if '<think>' in m['content'] %}T{% endif %}{{ m['content'] }}{% endfor %}",
    "{% for m in messages %}{{ m }}{% endfor %}",  # the whole message
    "{{ messages | tojson }}",
    "{% for m in messages %}{% set c = m['content'] %}{{ c }}{% endfor %}",
    "{% for m in messages %}{{ loop.previtem['content'] if loop.previtem else '' }}{{ m.content }}{% endfor %}",
    "{% for m in messages %}{{ m['content'] if loop.last else '' }}{% endfor %}",
    "{% for m in messages %}{{ m['content'][:10] }}{% endfor %}",
    "{% for m in messages %}{{ m.content.strip() }}{% endfor %}",
    "{% for m in messages %}{{ m['role'] }}{% endfor %}{{ messages[0] }}",
    "{% for m in messages[1:] %}{{ m['content'] }}{% endfor %}{{ messages[0]['content'] | upper }}",
    "{% macro f(x) %}{{ x }}{% endmacro %}{% for m in messages %}{{ f(m['content']) }}{% endfor %}",
    "{% for m in messages %}{{ m['content'] }}{% endfor %}{% for m in other %}{{ m['content'] | length }}{% endfor %}",
    "{% for m in messages %}{{ m['content'] }{% endfor %}",  # not even a template
]


def test_content_is_opaque_only_for_templates_that_write_content_verbatim(smol_tok):
    assert chat.content_is_opaque(smol_tok[0].chat_template)
    assert chat.content_is_opaque(chat.CHATML_TEMPLATE)
    assert chat.content_is_opaque("{% for m in messages %}{{ '<' ~ m.role ~ '>' ~ m.content }}{% endfor %}"
                                  "{{ messages | length }}{{ messages[0]['role'] }}")
    for template in _NOT_OPAQUE:
        assert not chat.content_is_opaque(template), template


@pytest.mark.parametrize("template,opaque", [
    (None, True),  # SmolLM2's own
    (_NOT_OPAQUE[1], False),  # inspects content
    ("{% for m in messages %}{{ m['role'] }}:{{ m['content'] if m['content'] else '-' }};{% endfor %}", False),
    ("{% for m in messages %}{{ m['content'] + '|' + m['content'] }}{% endfor %}", True),  # but writes it twice
])
def test_rendering_without_the_template_equals_apply_chat_template(template, opaque, smol_tok, chitchat_messages,
                                                                   monkeypatch):
    """An opaque template (SmolLM2's own) is rendered once per sequence of roles and gives apply_chat_template's
    text, also for contents holding the skeleton's sentinels or jinja syntax; a template that inspects content, or
    writes it twice, is rendered per conversation and gives its text too."""
    import copy

    tok = copy.deepcopy(smol_tok[0])
    if template is not None:
        tok.chat_template = template
    renderer = chat.Renderer.of(tok)
    assert renderer.opaque == opaque
    odd = [{"role": "user", "content": " \ue000 0 \ue001 {{ x }} <think>\n"},
           {"role": "assistant", "content": "\ue0011\ue000 {% raw %}  "}]
    convs = [odd, *chitchat_messages[:30]]
    calls, real, real_module = [], renderer.render, chat.render
    renderer.render = lambda messages: calls.append(1) or real(messages)
    monkeypatch.setattr(chat, "render", lambda *args, **kw: calls.append(1) or real_module(*args, **kw))
    renderer.skeletons.clear()  # skeletons are rendered once per sequence of roles: counted from here
    skeleton_calls = len({tuple(x["role"] for x in m) for m in convs})
    for (text, spans), m in zip(renderer.render_all(convs), convs):
        assert text == tok.apply_chat_template(m, tokenize=False)
        assert [text[a:b] for a, b in spans] == [x["content"] for x in m if x["role"] == "assistant"]
    # only SmolLM2's was never rendered per conversation
    assert (len(calls) == skeleton_calls) == (template is None), (len(calls), skeleton_calls)
