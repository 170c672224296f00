"""Imports run one way, and private names of other packages stay in ``sft/compat/``: every import of ``sft/`` read
from the source (module level and inside functions), as docs/layout.md draws it.

The order, top to bottom (a module imports its own folder or a folder below it, never one above):
face -> launchers -> app -> train -> model -> data -> config -> distributed -> compat -> foundation.
"""
import ast
import pathlib

from tests.helpers.paths import ROOT

LAYERS = [  # top first; a folder entry ("sft.app.") covers the package and every module in it
    ("face", ("sft.cli", "sft.__main__")),
    ("launchers", ("sft.ray.", "sft.distributed.__main__")),
    ("app", ("sft.app.",)),
    ("train", ("sft.train.",)),
    ("model", ("sft.model.",)),
    ("data", ("sft.data.",)),
    ("config", ("sft.config.",)),
    ("distributed", ("sft.distributed.",)),
    ("compat", ("sft.compat.",)),
    ("foundation", ("sft", "sft.errors", "sft.policy", "sft.logs", "sft.fsio")),
]
# Names other packages keep internal without a leading underscore (module, name).
INTERNAL = {("transformers.integrations.deepspeed", "HfTrainerDeepSpeedConfig"),
            ("deepspeed.checkpoint", "ds_to_universal")}
PUBLIC_UNDERSCORED = {"_exit", "_asdict", "_replace", "_fields", "_make"}  # os._exit, namedtuple's API


def layer(module: str) -> int:
    best, rank = -1, None
    for i, (_, entries) in enumerate(LAYERS):
        for e in entries:
            hit = module == e[:-1] or module.startswith(e) if e.endswith(".") else module == e
            if hit and len(e) > best:
                best, rank = len(e), i
    assert rank is not None, f"{module}: in no layer of tests/unit/test_imports.py; add its folder to LAYERS"
    return rank


def modules(root: pathlib.Path) -> dict[str, pathlib.Path]:
    out = {}
    for path in sorted((root / "sft").rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports(name: str, path: pathlib.Path, known: dict) -> list[tuple[int, str]]:
    """(line, sft module) for every import of an sft module in ``path``, relative ones resolved."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "sft"]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
            if base.split(".")[0] != "sft":
                continue
            for a in node.names:
                out.append((node.lineno, f"{base}.{a.name}" if f"{base}.{a.name}" in known else base))
    return out


def back_imports(root: pathlib.Path) -> list[str]:
    known = modules(root)
    bad = []
    for name, path in known.items():
        for line, target in imports(name, path, known):
            if target != name and layer(target) < layer(name):
                bad.append(f"{path.relative_to(root)}:{line}: {name} ({LAYERS[layer(name)][0]}) imports {target} "
                           f"({LAYERS[layer(target)][0]}), a layer above it")
    return bad


def cycles(root: pathlib.Path) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    known = modules(root)
    graph = {n: sorted({t for _, t in imports(n, p, known) if t in known and t != n}) for n, p in known.items()}
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))
    for v in graph:
        if v not in index:
            visit(v)
    return out


def bound(target) -> set[str]:
    """The names an assignment target binds: ``x``, ``obj.x`` (the last attribute only), and tuples of those."""
    if isinstance(target, ast.Name):
        return {target.id}
    if isinstance(target, ast.Attribute):
        return {target.attr}
    if isinstance(target, (ast.Tuple, ast.List)):
        return set().union(*(bound(e) for e in target.elts))
    return bound(target.value) if isinstance(target, ast.Starred) else set()


def foreign_private_names(root: pathlib.Path) -> list[str]:
    """Uses of another package's private names outside sft/compat/: ``from x import _y``, ``import x._y``, names
    listed in :data:`INTERNAL`, ``super()._y`` (overriding a private method), and ``obj._y`` / ``getattr(obj, "_y")``
    where ``_y`` is defined nowhere in sft."""
    trees = {p: ast.parse(p.read_text(encoding="utf-8")) for p in modules(root).values()}
    ours = set()
    for tree in trees.values():
        for n in ast.walk(tree):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                ours.add(n.name)
            elif isinstance(n, ast.arg):
                ours.add(n.arg)
            elif isinstance(n, ast.alias) and n.asname:
                ours.add(n.asname)
            elif isinstance(n, (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.For)):
                for t in (n.targets if isinstance(n, ast.Assign) else [n.target]):
                    ours.update(bound(t))
            elif isinstance(n, ast.withitem) and n.optional_vars is not None:
                ours.update(bound(n.optional_vars))
    bad = []
    for path, tree in trees.items():
        rel = path.relative_to(root)
        if rel.parts[:2] == ("sft", "compat"):
            continue
        for n in ast.walk(tree):
            what = None
            if isinstance(n, ast.ImportFrom) and n.module and not n.level and n.module.split(".")[0] not in (
                    "sft", "__future__"):
                names = [a.name for a in n.names]
                if any(c.startswith("_") for c in n.module.split(".")) or any(
                        a.startswith("_") or (n.module, a) in INTERNAL for a in names):
                    what = f"from {n.module} import {', '.join(names)}"
            elif isinstance(n, ast.Import) and any(c.startswith("_") for a in n.names for c in a.name.split(".")):
                what = "import " + ", ".join(a.name for a in n.names)
            elif isinstance(n, ast.Attribute) and n.attr.startswith("_") and not n.attr.startswith("__"):
                is_super = isinstance(n.value, ast.Call) and getattr(n.value.func, "id", None) == "super"
                if is_super or (n.attr not in ours and n.attr not in PUBLIC_UNDERSCORED):
                    what = ("super()." if is_super else ".") + n.attr
            elif (isinstance(n, ast.Call) and getattr(n.func, "id", None) in ("getattr", "hasattr", "setattr")
                  and len(n.args) > 1 and isinstance(n.args[1], ast.Constant) and isinstance(n.args[1].value, str)
                  and n.args[1].value.startswith("_") and not n.args[1].value.startswith("__")
                  and n.args[1].value not in ours):
                what = f'{n.func.id}(..., "{n.args[1].value}")'
            if what:
                bad.append(f"{rel}:{n.lineno}: {what} (a private name of another package: use it through sft/compat/)")
    return bad


def test_imports_run_one_way():
    assert back_imports(pathlib.Path(ROOT)) == []


def test_no_import_circles():
    assert cycles(pathlib.Path(ROOT)) == []


def test_private_names_of_other_packages_only_in_compat():
    assert foreign_private_names(pathlib.Path(ROOT)) == []


def test_the_checks_catch_a_back_import_a_circle_and_a_private_name(tmp_path):
    """The three checks fail on a copy of sft/ with a deliberate back-import (data -> launchers), a circle (two modules
    of data importing each other) and a private import (a data module importing transformers' private name)."""
    import shutil

    shutil.copytree(pathlib.Path(ROOT, "sft"), tmp_path / "sft")
    records = tmp_path / "sft" / "data" / "records" / "records.py"
    records.write_text(records.read_text(encoding="utf-8")
                       + "\n\ndef _back():\n    from sft.ray.flags import RayArguments\n")
    (tmp_path / "sft" / "data" / "a.py").write_text("from sft.data import b\n")
    (tmp_path / "sft" / "data" / "b.py").write_text("import sft.data.a\n")
    (tmp_path / "sft" / "data" / "c.py").write_text(
        "from transformers.utils.chat_template_utils import _compile_jinja_template\n")
    back = back_imports(tmp_path)
    assert len(back) == 1 and back[0].startswith("sft/data/records/records.py:") \
        and "imports sft.ray.flags (launchers)" in back[0]
    assert cycles(tmp_path) == [["sft.data.a", "sft.data.b"]]
    assert foreign_private_names(tmp_path) == [
        "sft/data/c.py:1: from transformers.utils.chat_template_utils import _compile_jinja_template "
        "(a private name of another package: use it through sft/compat/)"]
