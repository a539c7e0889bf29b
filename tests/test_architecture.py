"""Architecture rules of the house, read from the code's own imports (no import is executed).

R1  no import cycle between library modules (every import counts: top level, in functions,
    under TYPE_CHECKING), except inside the IR package ``hlo_passes/ir``;
R2  no private name (``_x``) imported from another project module;
R3  an import inside a function carries a ``# lazy: <why>`` comment (on its line or the line above);
R4  layers (``concerto_jax.jax_compat``, which imports only JAX, is the bottom layer: any
    module may import it): the IR imports nothing else of the project; the registry imports only the IR; the
    services (taskgraph, costmodel, simulator, scheduler, hlo_taskgraph, judge) import no pass;
    passes import no entry point (api, options, pipeline, first_step, deviceless);
R5  no package folder whose name a build-output ignore rule swallows;
R6  JAX's and jaxlib's internals (``jax._src``, ``jaxlib``) are imported by
    ``concerto_jax.jax_compat`` alone, the bottom layer every layer may import;
R7  every library module can be the first one a fresh interpreter imports.
ALLOWED_* list what the tree still breaks; each refactor step empties some of them.
"""

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("concerto_jax", "hlo_passes")
IR = "hlo_passes.ir"
SERVICES = ("concerto_jax.taskgraph", "concerto_jax.costmodel", "concerto_jax.simulator",
            "concerto_jax.scheduler", "concerto_jax.hlo_taskgraph", "concerto_jax.judge")
ENTRY_POINTS = ("concerto_jax.api", "concerto_jax.options", "concerto_jax.pipeline",
                "concerto_jax.first_step", "concerto_jax.deviceless",
                "concerto_jax.gpu_route", "concerto_jax.gpu_check")
JAX_COMPAT = "concerto_jax.jax_compat"
JAX_INTERNALS = ("jax._src", "jaxlib")
PASSES = ("hlo_passes.decompose", "hlo_passes.pipeline_loops", "hlo_passes.schedule",
          "hlo_passes.fuse_collectives", "hlo_passes.pin", "hlo_passes.replicated_reductions")
BUILD_DIRS = {"target", "build", "dist", "out", "bin", "obj"}

# What the tree still breaks; regenerate with `python tests/test_architecture.py`. The refactor's
# import steps are done: the scheduler's own cycle is all that is left (and the CLI may use the
# package face).
ALLOWED_CYCLES: set[frozenset[str]] = {
    frozenset({"concerto_jax.scheduler.rcpsp", "concerto_jax.scheduler.sgs"}),  # the scheduler's two halves
}
ALLOWED_PRIVATE: set[str] = set()
ALLOWED_UNMARKED_LAZY: dict[str, int] = {}  # module -> unmarked function-level imports
ALLOWED_LAYER_BREAKS: set[str] = {
    "concerto_jax.__main__:40",  # the CLI may use the package face: stays
}
ALLOWED_JAX_INTERNALS: set[str] = set()


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = path
    return out


MODULES = _modules()


def _resolve(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(name: str):
    """(line, target module, imported name or None, at top level?) of every project import."""
    path = MODULES[name]
    tree = ast.parse(path.read_text())
    top = {id(n) for n in tree.body}
    for n in tree.body:
        if isinstance(n, (ast.If, ast.Try)):
            top |= {id(x) for x in ast.walk(n)}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                target = full if full in MODULES else _resolve(node.module)
                if target:
                    yield node.lineno, target, None if full in MODULES else alias.name, id(node) in top
        elif isinstance(node, ast.Import):
            for alias in node.names:
                target = _resolve(alias.name)
                if target:
                    yield node.lineno, target, None, id(node) in top


def _graph() -> dict[str, set[str]]:
    return {m: {t for _, t, _, _ in _imports(m) if t != m} for m in MODULES}


def _cycles(graph):
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
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(frozenset(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def _under(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def test_no_import_cycles_outside_the_ir():
    found = {c for c in _cycles(_graph()) if not all(_under(m, (IR,)) for m in c)}
    assert found <= ALLOWED_CYCLES, sorted(sorted(c) for c in found - ALLOWED_CYCLES)


def _room(name: str) -> str:
    """The folder a module lives in (``concerto_jax.costmodel.fused`` -> ``concerto_jax.costmodel``);
    a module directly under a top-level package is a room of its own."""
    parts = name.split(".")
    for k in range(len(parts), 1, -1):
        prefix = ".".join(parts[:k])
        if prefix in MODULES and MODULES[prefix].name == "__init__.py" and k >= 2:
            return prefix if k == 2 or not _under(prefix, (IR,)) else IR
    return name


def test_no_cycles_between_folders():
    graph: dict[str, set[str]] = {}
    for m, targets in _graph().items():
        if m in PACKAGES:  # the package faces hand names on; they are not rooms
            continue
        graph.setdefault(_room(m), set()).update(
            _room(t) for t in targets if t not in PACKAGES and _room(t) != _room(m))
    for rooms in list(graph.values()):
        for r in rooms:
            graph.setdefault(r, set())
    found = set(_cycles(graph))
    assert found <= ALLOWED_CYCLES, sorted(sorted(c) for c in found - ALLOWED_CYCLES)


def test_library_imports_no_root_face():
    found = {f"{m}:{line}" for m in MODULES for line, t, _, _ in _imports(m)
             if t in PACKAGES and m not in PACKAGES}
    assert found <= ALLOWED_LAYER_BREAKS, sorted(found - ALLOWED_LAYER_BREAKS)


def test_no_private_names_across_modules():
    found = {f"{m}:{line} {t}.{n}" for m in MODULES for line, t, n, _ in _imports(m)
             if n and n.startswith("_") and not n.startswith("__") and t != m}
    keys = {f.split(":")[0] + " " + f.split(" ")[1] for f in found}
    assert keys <= ALLOWED_PRIVATE, sorted(keys - ALLOWED_PRIVATE)


def test_function_level_imports_say_why():
    lazy = re.compile(r"#\s*lazy:")
    counts = {}
    for m, path in MODULES.items():
        lines = path.read_text().splitlines()
        tree = ast.parse("\n".join(lines))
        top = {id(n) for n in tree.body}
        for n in tree.body:
            if isinstance(n, (ast.If, ast.Try)):
                top |= {id(x) for x in ast.walk(n)}
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in top:
                here = lines[node.lineno - 1] + (lines[node.lineno - 2] if node.lineno > 1 else "")
                if not lazy.search(here):
                    counts[m] = counts.get(m, 0) + 1
    over = {m: n for m, n in counts.items() if n > ALLOWED_UNMARKED_LAZY.get(m, 0)}
    assert not over, over


def _layer_breaks() -> set[str]:
    found = set()
    for m in MODULES:
        for _, t, _, _ in _imports(m):
            if t == JAX_COMPAT:
                continue
            if _under(m, (IR,)) and not _under(t, (IR,)):
                found.add(f"{m} -> {t}")
            if m == "hlo_passes.registry" and not _under(t, (IR, "hlo_passes.registry")):
                found.add(f"{m} -> {t}")
            if _under(m, SERVICES) and (_under(t, PASSES + ENTRY_POINTS) or (
                    t.startswith("hlo_passes") and not _under(t, (IR,)))):
                found.add(f"{m} -> {t}")
            if _under(m, PASSES) and _under(t, ENTRY_POINTS):
                found.add(f"{m} -> {t}")
            # entry points reach a pass through the registry only (Options.decompose's type excepted)
            if (_under(m, ENTRY_POINTS) and _under(t, PASSES)
                    and (m, t) != ("concerto_jax.options", "hlo_passes.decompose.options")):
                found.add(f"{m} -> {t}")
    return found


def test_layers():
    found = _layer_breaks()
    assert found <= ALLOWED_LAYER_BREAKS, sorted(found - ALLOWED_LAYER_BREAKS)


ALLOWED_BUILD_NAMED: set[str] = set()


def test_no_folder_named_like_build_output():
    bad = {str(p.relative_to(ROOT)) for pkg in PACKAGES for p in (ROOT / pkg).rglob("*")
           if p.is_dir() and p.name in BUILD_DIRS}
    assert bad <= ALLOWED_BUILD_NAMED, sorted(bad - ALLOWED_BUILD_NAMED)


def _jax_internals(name: str):
    """(line, module) of every import of JAX's or jaxlib's internals in module ``name``."""
    for node in ast.walk(ast.parse(MODULES[name].read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if _under(node.module, JAX_INTERNALS):
                yield node.lineno, node.module
            elif node.module == "jax":  # ``from jax import _src``
                yield from ((node.lineno, f"jax.{a.name}") for a in node.names if a.name == "_src")
        elif isinstance(node, ast.Import):
            yield from ((node.lineno, a.name) for a in node.names if _under(a.name, JAX_INTERNALS))


def test_jax_internals_only_through_jax_compat():
    found = {f"{m} {t}" for m in MODULES if m != JAX_COMPAT for _, t in _jax_internals(m)}
    assert found <= ALLOWED_JAX_INTERNALS, sorted(found - ALLOWED_JAX_INTERNALS)


IMPORT_FIRST_SKIP = {"concerto_jax.__main__",  # runs the demo when imported
                     "concerto_jax.gpu_check.__main__"}  # runs the checks when imported
IMPORT_FIRST_SCRIPT = r"""
import importlib, json, sys
packages, names = sys.argv[1].split(","), sys.argv[2:]
failures = {}
for name in names:
    for key in [k for k in sys.modules if k.split(".")[0] in packages]:
        del sys.modules[key]
    try:
        importlib.import_module(name)
    except ImportError as err:  # a ring through a package face: "partially initialized module"
        failures[name] = str(err).splitlines()[0][:200]
print(json.dumps(failures))
"""


def test_every_module_imports_first():
    """Any library module can be the first one imported (``import hlo_passes.pipeline_loops``
    in a fresh interpreter): no import ring closes through a package face. One subprocess;
    the project's modules are dropped from ``sys.modules`` before each import (JAX stays)."""
    import json
    import subprocess
    import sys

    names = sorted(set(MODULES) - IMPORT_FIRST_SKIP)
    out = subprocess.run([sys.executable, "-c", IMPORT_FIRST_SCRIPT, ",".join(PACKAGES), *names],
                         cwd=ROOT, capture_output=True, text=True, check=True)
    failures = json.loads(out.stdout.strip().splitlines()[-1])
    assert not failures, failures


def current_violations() -> dict:
    """Today's violations in allowlist form (``python test_architecture.py`` prints them): step 0
    pastes them into the ALLOWED_* sets of the tree it starts from."""
    graph = _graph()
    cycles = {c for c in _cycles(graph) if not all(_under(m, (IR,)) for m in c)}
    rooms: dict[str, set[str]] = {}
    for m, targets in graph.items():
        if m not in PACKAGES:
            rooms.setdefault(_room(m), set()).update(
                _room(t) for t in targets if t not in PACKAGES and _room(t) != _room(m))
    for targets in list(rooms.values()):
        for t in targets:
            rooms.setdefault(t, set())
    private = {f"{m} {t}.{n}" for m in MODULES for _, t, n, _ in _imports(m)
               if n and n.startswith("_") and not n.startswith("__") and t != m}
    lazy: dict[str, int] = {}
    for m, path in MODULES.items():
        tree = ast.parse(path.read_text())
        top = {id(n) for n in tree.body}
        for n in tree.body:
            if isinstance(n, (ast.If, ast.Try)):
                top |= {id(x) for x in ast.walk(n)}
        lines = path.read_text().splitlines()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in top:
                here = lines[node.lineno - 1] + (lines[node.lineno - 2] if node.lineno > 1 else "")
                if not re.search(r"#\s*lazy:", here):
                    lazy[m] = lazy.get(m, 0) + 1
    layers = set()
    for m in MODULES:
        for line, t, _, _ in _imports(m):
            if t in PACKAGES and m not in PACKAGES:
                layers.add(f"{m}:{line}")
    jax_internals = {f"{m} {t}" for m in MODULES if m != JAX_COMPAT for _, t in _jax_internals(m)}
    return {"ALLOWED_CYCLES": sorted(sorted(c) for c in cycles | set(_cycles(rooms))),
            "ALLOWED_PRIVATE": sorted(private), "ALLOWED_UNMARKED_LAZY": dict(sorted(lazy.items())),
            "ALLOWED_LAYER_BREAKS (root face)": sorted(layers), "ALLOWED_LAYER_BREAKS (layers)": sorted(_layer_breaks()),
            "ALLOWED_JAX_INTERNALS": sorted(jax_internals)}


if __name__ == "__main__":
    import pprint

    pprint.pprint(current_violations(), width=110)
