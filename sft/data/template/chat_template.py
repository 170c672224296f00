"""Chat templates: ChatML (the fallback for a tokenizer without one), whether a template writes message contents
verbatim and reads nothing else of them (:func:`content_is_opaque`), so that :class:`sft.data.template.chat.Renderer`
may fill a per-roles skeleton instead of rendering every conversation (the template compiled for fast rendering is
:func:`sft.compat.jinja.compile_template`: private names of transformers and jinja2)."""
from __future__ import annotations

from typing import Optional

# ChatML, as Qwen renders it (Qwen2 tokenizer_config.json, without tools), used when a tokenizer
# has no chat template of its own.
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if loop.first and message['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_ROLE_OR_CONTENT = ("role", "content")


def content_is_opaque(template: str, env=None) -> bool:
    """Whether ``template`` (a chat template) only ever writes each message's content verbatim into its output, so
    that its rendering of any conversation is its rendering of the same roles with the contents put in place.

    Decided on the template's jinja2 syntax tree, conservatively (False when unsure). True only when: every read
    of a ``"content"`` key or attribute sits in an expression written to the output directly or only through
    string concatenation (``+``, ``~``), never in a test, filter, call, condition or assignment; the loop
    variables over ``messages`` (``{% for message in messages %}``) are used only as ``message['role']`` /
    ``message['content']`` (or ``.role`` / ``.content``); ``messages`` itself only as that loop's sequence, as
    ``messages[i]['role'|'content']`` with a constant ``i``, or with ``|length``; nothing is assigned, imported,
    included or defined as a macro; ``loop.previtem`` / ``loop.nextitem`` are not read; and the environment
    neither escapes (``autoescape``) nor post-processes (``finalize``) output. Everything else the template may do
    depends only on the roles, the number of messages and the fixed variables, which the caller's skeleton (one
    rendering per sequence of roles) covers. ChatML (Qwen) and SmolLM2's templates qualify; a template that
    trims, inspects or rewrites content (e.g. removing earlier turns' reasoning) does not."""
    from jinja2 import Environment

    env = env or Environment()
    if getattr(env, "autoescape", False) is not False or getattr(env, "finalize", None) is not None:
        return False
    try:
        tree = env.parse(template)
    except Exception:
        return False
    parents = _parents(tree)
    loops = _message_loops(tree) if parents is not None else None
    return loops is not None and _names_read_messages(tree, parents, loops) and _content_only_written(tree, parents)


def _parents(tree) -> Optional[dict]:
    """Per node of ``tree`` (by ``id``), its parent; None where the tree holds a node :func:`content_is_opaque`
    refuses (an assignment, macro, import, include, block, scope, ...)."""
    from jinja2 import nodes

    banned = (nodes.Assign, nodes.AssignBlock, nodes.Macro, nodes.CallBlock, nodes.FilterBlock, nodes.With,
              nodes.Import, nodes.FromImport, nodes.Include, nodes.Extends, nodes.Block, nodes.Scope,
              nodes.OverlayScope, nodes.ScopedEvalContextModifier)
    parents: dict = {}
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, banned):
            return None
        for child in node.iter_child_nodes():
            parents[id(child)] = node
            stack.append(child)
    return parents


def _message_loops(tree) -> Optional[set]:
    """The names of the loop variables over ``messages``; None where a loop's target is not a name or such a name is
    reused by another loop."""
    from jinja2 import nodes

    loops = set()
    for f in tree.find_all(nodes.For):
        if not isinstance(f.target, nodes.Name):
            return None
        if isinstance(f.iter, nodes.Name) and f.iter.name == "messages" and not f.recursive and f.test is None:
            loops.add(f.target.name)
    if any(isinstance(f.target, nodes.Name) and f.target.name in loops and not
           (isinstance(f.iter, nodes.Name) and f.iter.name == "messages") for f in tree.find_all(nodes.For)):
        return None  # a loop variable's name reused for something else
    return loops


def _key_of(node):
    """The constant key a ``Getitem`` reads, the attribute a ``Getattr`` reads, else None."""
    from jinja2 import nodes

    if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const):
        return node.arg.value
    if isinstance(node, nodes.Getattr):
        return node.attr
    return None


def _message_item(node, parents: dict) -> bool:
    """Whether ``node`` (``message`` or ``messages[i]``) is read only for its role or content."""
    from jinja2 import nodes

    parent = parents.get(id(node))
    return (isinstance(parent, (nodes.Getitem, nodes.Getattr)) and parent.node is node
            and _key_of(parent) in _ROLE_OR_CONTENT)


def _names_read_messages(tree, parents: dict, loops: set) -> bool:
    """Whether the loop variables (``loops``) and ``messages`` are read only as :func:`content_is_opaque` allows,
    and ``loop.previtem`` / ``loop.nextitem`` never."""
    from jinja2 import nodes

    for name in tree.find_all(nodes.Name):
        if name.ctx != "load":
            continue
        parent = parents.get(id(name))
        if name.name in loops:
            if not _message_item(name, parents):
                return False
        elif name.name == "messages":
            if isinstance(parent, nodes.For) and parent.iter is name:
                continue
            if isinstance(parent, nodes.Filter) and parent.name == "length" and parent.node is name:
                continue
            if not (isinstance(parent, nodes.Getitem) and parent.node is name and isinstance(parent.arg, nodes.Const)
                    and isinstance(parent.arg.value, int) and _message_item(parent, parents)):
                return False
        elif name.name == "loop" and isinstance(parent, nodes.Getattr) and parent.attr in ("previtem", "nextitem"):
            return False
    return True


def _content_only_written(tree, parents: dict) -> bool:
    """Whether every read of a ``content`` key or attribute is written to the output directly or only through string
    concatenation."""
    from jinja2 import nodes

    for node in tree.find_all((nodes.Getitem, nodes.Getattr)):
        if _key_of(node) != "content":
            continue
        child, parent = node, parents.get(id(node))
        while isinstance(parent, (nodes.Add, nodes.Concat)):
            child, parent = parent, parents.get(id(parent))
        if not (isinstance(parent, nodes.Output) and any(n is child for n in parent.nodes)):
            return False
    return True


def parse_template_kwargs(text: str) -> dict:
    """``--chat_template_kwargs``: a JSON object of the extra variables every rendering of the chat template gets
    (``{"enable_thinking": false}``), as ``apply_chat_template(**kwargs)`` takes them.

    Raises:
        ValueError: not JSON, not an object, or a key that is not a Jinja name (the reason, one line).
    """
    import json
    import keyword

    try:
        value = json.loads(text)
    except ValueError as e:
        raise ValueError(f"not JSON ({e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"a JSON object is needed, e.g. '{{\"enable_thinking\": false}}', not {type(value).__name__}")
    bad = [k for k in value if not k.isidentifier() or keyword.iskeyword(k) or k in _RENDER_NAMES]
    if bad:
        raise ValueError(f"{', '.join(map(repr, bad))}: not a name a chat template can read as a variable of its own "
                         f"(a Jinja name other than {', '.join(_RENDER_NAMES)})")
    return value


_RENDER_NAMES = ("messages", "tools", "documents", "add_generation_prompt")


def with_template_kwargs(template: str, kwargs: dict) -> str:
    """``template`` with ``kwargs`` (:func:`parse_template_kwargs`) as defaults written into it: ``{%- if name is not
    defined %}{%- set name = value %}{%- endif %}`` per variable, first. Every rendering then gets them (this
    package's, ``apply_chat_template``'s, and inference's from the saved tokenizer, where a caller's own value still
    wins); the dataset cache, keyed on the template's text, tells runs with other values apart."""
    head = "".join(f"{{%- if {k} is not defined %}}{{%- set {k} = {_jinja_literal(v)} %}}{{%- endif %}}"
                   for k, v in kwargs.items())
    return head + template


def _jinja_literal(value) -> str:
    """A JSON value as a Jinja literal (``null`` -> ``none``; JSON's strings, numbers, lists and objects are
    Jinja's)."""
    import json

    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ", ".join(map(_jinja_literal, value)) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k)}: {_jinja_literal(v)}" for k, v in value.items()) + "}"
    return json.dumps(value)


def render_failure(error: Exception) -> str:
    """The reason a chat template failed to render, in one line, with what it means where jinja2's message alone
    does not say: a variable the template needs that ``apply_chat_template`` does not give (firefunction-v2's
    ``functions``: pass it with ``--chat_template_kwargs``), an operation the sandbox of ``apply_chat_template``
    refuses (``list.append``: a template written for another engine, such as llama.cpp's), a value ``tojson`` cannot
    write (jinja2's ``map`` gives a generator, which llama.cpp's engine turns into a list)."""
    import jinja2

    reason = " ".join(str(error).split()) or type(error).__name__
    if isinstance(error, jinja2.exceptions.UndefinedError) and reason.endswith(" is undefined"):
        name = reason[:-len(" is undefined")].strip("'")
        if name in ("bos_token", "eos_token"):
            return (f"{reason} (the template writes the tokenizer's {name.split('_')[0]} token, and the tokenizer "
                    "has none: set it in tokenizer_config.json, or use another template)")
        return (f"{reason} (the template reads a variable {name} that it does not set for this conversation and "
                f"apply_chat_template does not give: where the model's card passes {name} to apply_chat_template, "
                f"pass it with --chat_template_kwargs '{{\"{name}\": ...}}')")
    if isinstance(error, jinja2.exceptions.SecurityError):
        return (f"{reason} (the sandboxed Jinja of transformers' apply_chat_template refuses this operation, so no "
                "Hugging Face-based trainer or server renders this template: it was written for another engine, "
                "e.g. llama.cpp's)")
    if isinstance(error, TypeError) and "JSON serializable" in reason and "generator" in reason:
        return (f"{reason} (the template gives tojson a jinja2 generator, e.g. of map(), which apply_chat_template "
                "cannot write: it was written for an engine that makes it a list, e.g. llama.cpp's)")
    return reason

