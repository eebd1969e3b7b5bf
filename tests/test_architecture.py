"""The shape of the package, checked by reading it: imports point one way, functions stay short,
every backend keeps the contract, the public surface stays narrow."""

from __future__ import annotations

import ast
import inspect
import re
from itertools import pairwise
from pathlib import Path

import pytest

import stateshift
from stateshift.backends import REGISTRY, base

SRC = Path(stateshift.__file__).resolve().parent
ENGINE = [
    "core/state.py",
    "core/snapshot.py",
    "core/transfer.py",
    "core/slot.py",
    "core/pool.py",
    "core/layout.py",
    "core/groups.py",
    "core/swap.py",
    "core/source.py",
    "core/stable.py",
    "core/locking.py",
    "core/disk.py",
    "core/ranks.py",
    "core/touch.py",
    "core/engine.py",
    "core/verbs.py",
    "core/tiers.py",
    "core/disk_tier.py",
]
MAX_LINES = 60
#: packages still being cut to size (issue 9 rewrites checkpoint/; this set empties when it lands)
PENDING = ()


def _imports(path: Path) -> list[str]:
    """Absolute module names a file imports (relative imports resolved against the package)."""
    package = ["stateshift", *path.relative_to(SRC).parent.parts]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base_parts = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base_parts, *(node.module.split(".") if node.module else [])])
            out += [module] + [f"{module}.{a.name}" for a in node.names]
    return out


@pytest.mark.parametrize("name", ENGINE)
def test_engine_imports_nothing_above_it(name):
    path = SRC / name
    assert path.exists(), name
    above = (
        "stateshift.backends",
        "stateshift.checkpoint",
        "stateshift.rl",
        "stateshift.train",
        "stateshift.cli",
        "stateshift.integrations",
    )
    bad = [m for m in _imports(path) if m.startswith(above)]
    assert not bad, f"{name} imports {bad}"


def test_nothing_outside_integrations_imports_them():
    """Integrations are imported only on request: no module of the engine or the libraries imports one."""
    bad = {
        str(path.relative_to(SRC)): mods
        for path in sorted(SRC.rglob("*.py"))
        if "integrations" not in path.relative_to(SRC).parts
        and (mods := [m for m in _imports(path) if m.startswith("stateshift.integrations")])
    }
    assert not bad, bad


def test_integrations_import_no_framework_at_module_level():
    """An integration imports its framework only inside a function (``install()``), never at import time."""
    for path in sorted((SRC / "integrations").rglob("*.py")):
        tree = ast.parse(path.read_text())
        top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
        names = [a.name for n in top if isinstance(n, ast.Import) for a in n.names]
        names += [n.module or "" for n in top if isinstance(n, ast.ImportFrom) and n.level == 0]
        assert not [m for m in names if m.split(".")[0] in ("verl", "megatron", "transformers")], (path, names)


def test_model_state_stays_a_facade():
    """``ModelState`` is the user's verbs over the internal core (``core/engine.py``); its module stays short."""
    assert len((SRC / "core/state.py").read_text().splitlines()) <= 500


def test_checkpoint_package_does_not_grow():
    """``checkpoint/`` holds its line count, counted on ``ruff format``-ed code (a ratchet: lower it as the package
    shrinks; the aim is 1,900)."""
    n = sum(len(p.read_text().splitlines()) for p in (SRC / "checkpoint").glob("*.py"))
    assert n <= 2751, f"checkpoint/ has {n} lines"


def _module_name(path: Path) -> str:
    parts = ["stateshift", *path.relative_to(SRC).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph() -> dict[str, set[str]]:
    """Each module of ``src/`` -> the modules of ``src/`` it imports anywhere in the file (inside functions and
    ``TYPE_CHECKING`` blocks too). ``from package import name`` is an edge to ``package.name`` when that is a
    module, else to ``package``; a name is resolved to the longest module of ``src/`` that prefixes it."""
    modules = {_module_name(p): p for p in SRC.rglob("*.py")}

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for mod, path in modules.items():
        package = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
        names = []
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names += [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = package[: len(package) - node.level + 1] if node.level else []
                where = ".".join([*base, *(node.module.split(".") if node.module else [])])
                names += [f"{where}.{a.name}" if f"{where}.{a.name}" in modules else where for a in node.names]
        graph[mod] = {r for n in names if (r := resolve(n)) is not None and r != mod}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    component.append(top)
                    if top == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles_anywhere_lazy_imports_included():
    """No module of ``src/`` reaches itself through imports, counting those inside functions and under
    ``TYPE_CHECKING``: a shared piece lives below both of its users."""
    graph = _import_graph()
    assert "stateshift.train.loop" in graph["stateshift.train.launch"]  # (the graph sees what it should)
    cycles = _cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(
        " | ".join(f"{m} -> {sorted(set(graph[m]) & set(c))}" for m in c) for c in cycles
    )


def test_the_library_imports_nothing_from_the_application():
    """``stateshift train`` (``stateshift.train``) sits on the library; only it and the CLI import it."""
    graph = _import_graph()
    app = ("stateshift.train", "stateshift.cli", "stateshift.__main__")
    bad = {
        m: sorted(d for d in deps if d == "stateshift.train" or d.startswith("stateshift.train."))
        for m, deps in graph.items()
        if not (m in app or m.startswith(tuple(a + "." for a in app)))
    }
    assert not {m: d for m, d in bad.items() if d}, bad


def _provenance_and_plots(path: Path) -> list[str]:
    """What ``path`` (a module of ``src/``) does that belongs to ``benchmarks/``: a ``git`` command line, a read
    of ``/proc/cpuinfo``, an import of matplotlib."""
    found = [f"imports {n}" for n in _imports(path) if n.split(".")[0] == "matplotlib"]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.List | ast.Tuple) and node.elts and getattr(node.elts[0], "value", None) == "git":
            found.append(f"line {node.lineno}: runs git")
        elif isinstance(node, ast.Constant) and node.value == "/proc/cpuinfo":
            found.append(f"line {node.lineno}: reads /proc/cpuinfo")
    return found


def test_the_library_records_no_provenance_and_draws_no_plot():
    """Benchmark provenance (the commit through ``git rev-parse``, the host's CPU) and plots live in
    ``benchmarks/_harness.py``: no module of ``src/`` runs git or reads ``/proc/cpuinfo``, and none imports
    matplotlib but the trainer application's curves (``stateshift.train``, the 'rl' extra)."""
    bad = {}
    for path in sorted(SRC.rglob("*.py")):
        found = _provenance_and_plots(path)
        if path.relative_to(SRC).parts[0] == "train":
            found = [f for f in found if not f.startswith("imports matplotlib")]
        if found:
            bad[str(path.relative_to(SRC))] = found
    assert not bad, bad


def _exception_classes(tree: ast.AST, known: set[str]) -> list[ast.ClassDef]:
    """Classes of ``tree`` deriving (by the name of a base) from an exception class in ``known``."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            bases = {b.attr if isinstance(b, ast.Attribute) else getattr(b, "id", "") for b in node.bases}
            if bases & known:
                out.append(node)
    return out


def test_exception_classes_are_defined_only_in_errors_py():
    """Every exception class of ``src/`` is in ``stateshift/errors.py``; a private one (``_Name``) may stay in
    the one module that raises and catches it."""
    import builtins

    import stateshift.errors as errors

    known = {n for n, v in vars(builtins).items() if isinstance(v, type) and issubclass(v, BaseException)}
    known |= {n for n, v in vars(errors).items() if isinstance(v, type) and issubclass(v, BaseException)}
    trees = {p: ast.parse(p.read_text()) for p in sorted(SRC.rglob("*.py")) if p != SRC / "errors.py"}
    found: dict[str, list[str]] = {}
    while True:  # (a class deriving from one found in another module counts too)
        before = len(known)
        for path, tree in trees.items():
            for cls in _exception_classes(tree, known):
                known.add(cls.name)
                found.setdefault(str(path.relative_to(SRC)), [])
                if cls.name not in found[str(path.relative_to(SRC))]:
                    found[str(path.relative_to(SRC))].append(cls.name)
        if len(known) == before:
            break
    public = {p: [n for n in names if not n.startswith("_")] for p, names in found.items()}
    assert not {p: n for p, n in public.items() if n}, f"exception classes outside errors.py: {public}"
    for path, names in found.items():  # a private one is raised and caught in its own module only
        for name in names:
            users = [
                str(p.relative_to(SRC))
                for p, t in trees.items()
                if str(p.relative_to(SRC)) != path
                and any(isinstance(n, ast.Name) and n.id == name for n in ast.walk(t))
            ]
            assert not users, f"{path}: {name} is private but used in {users}"


def test_every_engine_module_is_listed():
    assert sorted(str(p.relative_to(SRC)) for p in (SRC / "core").glob("*.py") if p.name != "__init__.py") == sorted(
        ENGINE
    )


def _functions(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            start = min([node.lineno] + [d.lineno for d in node.decorator_list])
            yield node.name, node.lineno, node.end_lineno - start + 1


def test_no_function_is_longer_than_60_lines():
    long = []
    for path in sorted(SRC.rglob("*.py")):
        if path.relative_to(SRC).parts[0] in PENDING:
            continue
        for name, line, n in _functions(ast.parse(path.read_text())):
            if n > MAX_LINES:
                long.append(f"{path.relative_to(SRC)}:{line} {name} ({n} lines)")
    assert not long, "functions over 60 lines (decorators and docstrings included):\n" + "\n".join(long)


def _contract() -> dict[str, object]:
    """Every member the Backend protocol (with its Source part) requires: data members and methods."""
    members: dict[str, object] = {}
    for proto in reversed(base.Backend.__mro__):
        if proto in (object,) or not getattr(proto, "_is_protocol", False):
            continue
        for name in getattr(proto, "__annotations__", {}):
            members[name] = None
        for name, value in vars(proto).items():
            if callable(value) and not name.startswith("_"):
                members[name] = value
    return members


def _shipped_backend_classes() -> list[type]:
    import importlib

    classes = []
    for module_path in REGISTRY.values():
        module = importlib.import_module(module_path)
        for name in dir(module):
            obj = getattr(module, name)
            if inspect.isclass(obj) and name.endswith("Backend") and obj.__module__.startswith("stateshift.backends"):
                classes.append(obj)
    return sorted(set(classes), key=lambda c: c.__qualname__)


def test_contract_lists_what_the_engine_and_library_call():
    assert {
        "name",
        "groups",
        "forward_groups",
        "prepare",
        "entries",
        "install_guards",
        "static_groups",
        "coverage",
        "checkpoint_facts",
        "rebuild_plugin",
    } <= set(_contract())


@pytest.mark.parametrize("cls", _shipped_backend_classes(), ids=lambda c: c.__qualname__)
def test_every_shipped_backend_keeps_the_contract(cls):
    missing = [m for m in _contract() if not hasattr(cls, m)]
    assert not missing, f"{cls.__qualname__} lacks {missing}"
    for name, proto_fn in _contract().items():
        if proto_fn is None:
            continue
        want = list(inspect.signature(proto_fn).parameters)
        have = list(inspect.signature(getattr(cls, name)).parameters)
        assert have == want, f"{cls.__qualname__}.{name}{tuple(have)} != contract {tuple(want)}"


def test_the_torch_backends_are_runtime_instances_of_the_protocol():
    import torch

    from stateshift import ModelState

    model = torch.nn.Linear(2, 2)
    state = ModelState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert all(isinstance(b, base.Backend) for b in state.backends)
    assert len(_shipped_backend_classes()) >= 6  # torch, torch-optim, fsdp2 x2, megatron x2


def test_public_surface_is_narrow():
    assert len(stateshift.__all__) <= 16, stateshift.__all__
    assert set(stateshift.__all__) == {
        "ModelState",
        "Snapshot",
        "Residency",
        "PoolStats",
        "HostPool",
        "watch_thread",
        "__version__",
        *(n for n in stateshift.__all__ if n.endswith("Error")),
    }
    errors = [getattr(stateshift, n) for n in stateshift.__all__ if n.endswith("Error")]
    assert all(issubclass(e, stateshift.StateShiftError) for e in errors)
    assert {e.__module__ for e in errors} == {"stateshift.errors"}  # every error lives in one module


def test_errors_py_defines_at_most_a_dozen_public_exception_classes_each_with_its_kinds():
    """A dozen classes a newcomer reads at once; a case of one is its ``kind`` (a ``Literal`` of short strings)."""
    import stateshift.errors as errors

    public = [
        v
        for n, v in vars(errors).items()
        if isinstance(v, type)
        and issubclass(v, BaseException)
        and v.__module__ == errors.__name__
        and not n.startswith("_")
    ]
    assert len(public) <= 12, [c.__name__ for c in public]
    for cls in public:
        if cls is not errors.StateShiftError:
            assert cls.kinds and all(k.isidentifier() and k.islower() for k in cls.kinds), cls
            with pytest.raises(ValueError, match="unknown kind"):
                cls("no such kind", "x")


# ----------------------------------------------------------------------------- the front page and history
ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 150
#: where a commit may be named: the generated results page and the result files it is made from
HASHES_ALLOWED = ("docs/results.md", "benchmarks/results/")
HEX_WORD = re.compile(r"(?<![0-9A-Za-z_])[0-9a-f]{7,40}(?![0-9A-Za-z_])")


def _looks_like_a_commit(word: str) -> bool:
    """A hex word that reads as a commit hash: letters and digits mixed, at least five distinct characters,
    and not an ascending run (test data such as ``0123abcd`` or ``89abcdef``: at most one descent)."""
    letters, digits = set(word) - set("0123456789"), set(word) & set("0123456789")
    if not letters or not digits or len(set(word)) < 5:
        return False
    descents = sum(int(a, 16) > int(b, 16) for a, b in pairwise(word))
    return descents > 1


def _prose_and_code() -> list[Path]:
    """README, CHANGELOG, every page of docs/ but the generated one, every text file under src/ and tests/."""
    files = [ROOT / "README.md", ROOT / "CHANGELOG.md", *(ROOT / "docs").rglob("*.md")]
    for top in ("src", "tests"):
        files += [p for p in (ROOT / top).rglob("*") if p.suffix in {".py", ".md", ".sh", ".txt", ".yaml"}]
    return [p for p in files if p.is_file() and not str(p.relative_to(ROOT)).startswith(HASHES_ALLOWED)]


def test_readme_is_a_front_page():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; the rest belongs in docs/"


def test_no_commit_hash_outside_the_results():
    """History lives in git and CHANGELOG.md: no prose page, source file or test names the commit it came
    from (the generated docs/results.md and the result files may: each result says what it measured)."""
    found = []
    for path in _prose_and_code():
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            found += [f"{path.relative_to(ROOT)}:{n}: {w}" for w in HEX_WORD.findall(line) if _looks_like_a_commit(w)]
    assert not found, "commit hashes outside docs/results.md and benchmarks/results/:\n" + "\n".join(found)
