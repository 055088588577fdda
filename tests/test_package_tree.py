"""The package's shape, checked: no import cycles inside moeflow/, module docstrings of at most 10 lines, no
benchmark-record citations or measurement dates in library code, and a kernels index that lists every module."""
import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1] / "moeflow"


def _modules() -> dict[str, tuple[pathlib.Path, bool]]:
    """dotted name -> (path, is a package's __init__)"""
    mods = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        is_init = parts[-1] == "__init__"
        mods[".".join(parts[:-1] if is_init else parts)] = (path, is_init)
    return mods


def import_graph() -> dict[str, set[str]]:
    """module -> the moeflow modules it imports anywhere in its body (function-level and TYPE_CHECKING imports
    included: a cycle through a lazy import is still a cycle of the design). ``from pkg import sub`` is an edge to
    pkg.sub alone (the package's __init__ runs first anyway, as for every submodule)."""
    mods = _modules()
    graph = {m: set() for m in mods}
    for mod, (path, is_init) in mods.items():
        package = mod if is_init else mod.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in mods]
                targets = subs or [target]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            graph[mod].update(t for t in targets if t in mods and t != mod)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
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
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_module_docstrings_are_short():
    long = {}
    for path in ROOT.rglob("*.py"):
        doc = ast.get_docstring(ast.parse(path.read_text()))
        if doc and len(doc.splitlines()) > 10:
            long[str(path.relative_to(ROOT))] = len(doc.splitlines())
    assert not long, f"module docstrings over 10 lines: {long}"


def test_no_benchmark_records_cited_in_library_code():
    pattern = re.compile(r"benchmarks/(results|experiments)|PERFORMANCE_HISTORY|_20\d\d-\d\d-\d\d")
    hits = [f"{path.relative_to(ROOT)}:{n}" for path in ROOT.rglob("*.py")
            for n, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert not hits, f"library code cites benchmark records: {hits}"


def test_kernels_index_lists_every_module():
    index = ast.get_docstring(ast.parse((ROOT / "kernels" / "__init__.py").read_text())) or ""
    modules = [p.relative_to(ROOT / "kernels").as_posix() for p in (ROOT / "kernels").rglob("*.py")
               if p.name != "__init__.py"]
    missing = [m for m in modules if pathlib.PurePosixPath(m).name not in index]
    assert not missing, f"kernels/__init__.py does not list {missing}"
