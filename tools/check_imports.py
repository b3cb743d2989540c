"""Check the direction of the project's imports, and that there are no import cycles.

    python tools/check_imports.py            # prints the package graph; exit 1 on any violation

Every `import` / `from ... import` in gspo_errors/, gspo_tables/, gspo_megatron/, model_specs/, rollout/ and tools/ counts,
the ones inside functions included (a lazy import is still a dependency). An import resolves to
the most specific project module (`from a.b import c` is a.b.c when that is a module, else a.b);
a package whose __init__ re-exports lazily (an `_EXPORTS` table of name -> submodule) depends on
those submodules. The rules (docs/architecture.md, "Import rules"):
- gspo_errors, the error base, is the bottom: it imports nothing of the project, and every
  package imports it downward; gspo_tables (the Table every extension point is, and settings built
  from plain data) sits on it and imports nothing else of the project, nor torch;
- nothing imports gspo_megatron's root (its __init__) but tests and users: the error base is
  gspo_errors, the entry points are cli and trainer;
- gspo_megatron's top holds only the entry points (cli and trainer); everything else lives in a
  package;
- model_specs knows Hugging Face and megatron-core, nothing of the RL library (no rollout, nothing
  of gspo_megatron);
- rollout knows nothing of megatron (no megatron or model_specs, nothing of gspo_megatron);
- gspo_megatron.algorithms is pure torch (no megatron, no other gspo_megatron package);
- the library packages (actor, checkpoint, lora, parallel, sync) import none of the run's packages
  (config, run, driver, trainer, cli); parallel no other package; checkpoint no actor, sync or
  planner; actor no sync or planner; lora (the adapters) no actor, checkpoint, sync or planner; driver no run, trainer or cli; config no run, driver,
  trainer or cli; nothing imports cli, and only cli imports trainer;
- loading the run config (gspo_megatron.config and what it imports when imported, function
  bodies aside) imports neither torch nor megatron-core, and neither do the command line's first
  checks (gspo_megatron.run.preflight): those errors come before the heavy imports;
- no two modules of gspo_megatron have near-twin names (the same once underscores and a final
  s or es are dropped: micro_batch / microbatches, routing / routing);
- no module imports itself through a chain of others (no cycles; an import under `if
  TYPE_CHECKING:` never runs, and is how a type names a module further up the chain: it counts
  for every other rule), and no package does either:
  the top-level packages, and the packages inside each, form no cycle once a package stands for
  the modules it holds (rollout.servers -> rollout.generation -> rollout.servers is refused even
  when the modules themselves form none);
- no two modules import each other, not even one of them under `if TYPE_CHECKING:` (a module
  that needs the type of the one that imports it is handed that one's parts, or a Protocol of
  them, instead);
- no package holds more than 12 modules at its own level (a flat room is zoned into packages).
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("gspo_errors", "gspo_tables", "gspo_megatron", "model_specs", "rollout", "tools")
MAX_MODULES_PER_PACKAGE = 12


def module_files() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def _lazy_exports(tree: ast.Module, module: str) -> set[str]:
    """Submodules named by an `_EXPORTS = {"name": "submodule", ...}` table (PEP 562 packages)."""
    found = set()
    for node in tree.body:
        if (isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "_EXPORTS"
                                                 for t in node.targets)
                and isinstance(node.value, ast.Dict)):
            found |= {f"{module}.{v.value}" for v in node.value.values
                      if isinstance(v, ast.Constant) and isinstance(v.value, str)}
    return found


def _eager_nodes(tree: ast.Module):
    """The nodes that run when the module is imported (function bodies left out)."""
    todo: list[ast.AST] = list(tree.body)
    while todo:
        node = todo.pop()
        yield node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            todo.extend(ast.iter_child_nodes(node))


def _type_checking_imports(tree: ast.Module) -> set[int]:
    """ids of the import nodes under `if TYPE_CHECKING:` (or `typing.TYPE_CHECKING`)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and (
                (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING")
                or (isinstance(node.test, ast.Attribute) and node.test.attr == "TYPE_CHECKING")):
            found |= {id(n) for stmt in node.body for n in ast.walk(stmt)
                      if isinstance(n, (ast.Import, ast.ImportFrom))}
    return found


def imports_of(module: str, path: Path, modules: set[str], eager_only: bool = False,
               runtime_only: bool = False) -> tuple[set[str], set[str]]:
    """(project modules, external top-level packages) that `module` imports; eager_only: only
    the imports that run when the module itself is imported; runtime_only: without the imports
    under `if TYPE_CHECKING:`."""
    tree = ast.parse(path.read_text(), str(path))
    type_only = _type_checking_imports(tree) if runtime_only else set()
    is_pkg = path.name == "__init__.py"
    internal, external = (set() if eager_only else _lazy_exports(tree, module)), set()

    def add(name: str) -> None:
        top = name.split(".")[0]
        if top not in PACKAGES:
            external.add(top)
            return
        while name and name not in modules:
            name = name.rpartition(".")[0]
        if name and name != module:
            internal.add(name)

    for node in (_eager_nodes(tree) if eager_only else ast.walk(tree)):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.Import):
            for a in node.names:
                add(a.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = module.split(".")
                base = base if is_pkg else base[:-1]
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""  # (set whenever the import is not relative)
            for a in node.names:
                full = f"{target}.{a.name}"
                add(full if full in modules else target)
    return internal, external


def graph(eager_only: bool = False, runtime_only: bool = False
          ) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    files = module_files()
    internal, external = {}, {}
    for module, path in files.items():
        internal[module], external[module] = imports_of(module, path, set(files), eager_only,
                                                        runtime_only)
    return internal, external


def find_cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), plus self-loops."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in edges.get(v, ()):
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def mutual_pairs(edges: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(a, b), a < b, for every two modules that import each other."""
    return [(a, b) for a in sorted(edges) for b in sorted(edges[a]) if a < b and a in edges.get(b, ())]


def closure(edges: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        v = todo.pop()
        if v not in seen:
            seen.add(v)
            todo += edges.get(v, ())
    return seen


def violations() -> list[str]:
    internal, external = graph()
    problems = []

    def forbid(prefix: str, banned_internal: tuple[str, ...], banned_external: tuple[str, ...],
               why: str) -> None:
        for m in sorted(internal):
            if m != prefix and not m.startswith(prefix + "."):
                continue
            bad = sorted(d for d in internal[m] if d.split(".")[0] in banned_internal
                         or any(d == b or d.startswith(b + ".") for b in banned_internal))
            bad += sorted(x for x in external[m] if x in banned_external)
            if bad:
                problems.append(f"{m} imports {', '.join(bad)} ({why})")

    sub = tuple(f"gspo_megatron.{p}" for p in ("actor", "algorithms", "checkpoint", "lora", "parallel", "sync",
                                                "config", "driver", "run", "planner", "trainer", "cli"))
    forbid("gspo_errors", PACKAGES, (), "the error base is the bottom: it imports nothing of the project")
    forbid("gspo_tables", tuple(p for p in PACKAGES if p not in ("gspo_errors", "gspo_tables")), ("torch", "megatron"),
           "the tables' shape sits at the bottom beside the error base: every package's tables are made of it")
    forbid("model_specs", ("gspo_megatron", "rollout"), (),
           "model_specs knows HF and megatron-core, nothing of the RL library; errors from gspo_errors")
    forbid("rollout", ("gspo_megatron", "model_specs"), ("megatron",),
           "rollout knows nothing of megatron or the trainer; errors from gspo_errors")
    for m in sorted(internal):
        if "gspo_megatron" in internal[m]:
            problems.append(f"{m} imports gspo_megatron's root (import the error base from gspo_errors, "
                            "or the module that defines the name)")
    run_side = tuple(f"gspo_megatron.{p}" for p in ("config", "run", "driver", "trainer", "cli"))
    library = tuple(f"gspo_megatron.{p}" for p in ("actor", "checkpoint", "lora", "parallel", "sync", "planner"))
    forbid("gspo_megatron.algorithms", library + run_side, ("megatron",), "algorithms are pure torch")
    for lib in ("actor", "checkpoint", "lora", "parallel", "sync"):
        forbid(f"gspo_megatron.{lib}", run_side, (), "the library packages know nothing of the run")
    forbid("gspo_megatron.parallel", tuple(p for p in sub if p != "gspo_megatron.parallel"), (),
           "parallel is the bottom of the library: megatron-core and torch only")
    forbid("gspo_megatron.checkpoint", ("gspo_megatron.actor", "gspo_megatron.sync", "gspo_megatron.planner"), (),
           "checkpoints know model chunks, not the actor that trains them")
    forbid("gspo_megatron.actor", ("gspo_megatron.sync", "gspo_megatron.planner"), (),
           "the actor knows nothing of the weight sync or the planner")
    forbid("gspo_megatron.lora", ("gspo_megatron.actor", "gspo_megatron.checkpoint", "gspo_megatron.sync",
                                  "gspo_megatron.planner"), (),
           "the adapters sit below the actor, the checkpoints and the sync that use them")
    forbid("gspo_megatron.driver", ("gspo_megatron.run", "gspo_megatron.trainer", "gspo_megatron.cli"), (),
           "run/ builds the driver")
    forbid("gspo_megatron.config", ("gspo_megatron.run", "gspo_megatron.driver", "gspo_megatron.trainer",
                                    "gspo_megatron.cli"), (), "the run reads the config, not the reverse")
    for m in sorted(internal):
        for top, why in (("gspo_megatron.cli", "the command line is the top"),
                         ("gspo_megatron.trainer", "only the command line runs the loop")):
            if m not in ("gspo_megatron.cli", top) and top in internal[m]:
                problems.append(f"{m} imports {top} ({why})")
    files = module_files()
    for m, path in files.items():
        if (m.count(".") == 1 and m.startswith("gspo_megatron.") and path.name != "__init__.py"
                and m not in ("gspo_megatron.cli", "gspo_megatron.trainer")):
            problems.append(f"{m} sits at gspo_megatron's top, where only cli and trainer do (give it a package)")
    twins: dict[str, list[str]] = {}
    for m, path in files.items():
        if m.startswith("gspo_megatron.") and path.name != "__init__.py":
            stem = path.stem.replace("_", "")
            twins.setdefault(stem[:-2] if stem.endswith("es") else stem.removesuffix("s"), []).append(m)
    for names in twins.values():
        if len(names) > 1:
            problems.append(f"near-twin module names: {', '.join(sorted(names))} (a name says which is which)")
    eager_internal, eager_external = graph(eager_only=True)
    for light in ("gspo_megatron.config", "gspo_megatron.run.preflight"):
        for m in sorted(closure(eager_internal, light)):
            heavy = eager_external.get(m, set()) & {"torch", "megatron", "transformer_engine"}
            if heavy:
                problems.append(f"{m} imports {', '.join(sorted(heavy))}, and {light} imports {m}: "
                                "it must load without torch")
    runtime = graph(runtime_only=True)[0]
    for comp in find_cycles(runtime):
        problems.append(f"import cycle: {' <-> '.join(comp)}")
    for a, b in mutual_pairs(internal):
        if not (b in runtime.get(a, ()) and a in runtime.get(b, ())):  # else an import cycle, above
            problems.append(f"modules that import each other: {a} <-> {b} (one of them under TYPE_CHECKING: "
                            "hand the module its collaborators, or a Protocol of them, instead)")
    for comp in find_cycles(folder_graph(internal, files)):
        problems.append(f"package cycle: {' <-> '.join(comp)} (a package imports another that imports it back)")
    counts: dict[str, int] = {}
    for m, path in files.items():
        if path.name != "__init__.py":
            folder = str(path.parent.relative_to(ROOT))
            counts[folder] = counts.get(folder, 0) + 1
    for folder, n in sorted(counts.items()):
        if n > MAX_MODULES_PER_PACKAGE and folder.split("/")[0] != "tools":
            problems.append(f"{folder}/ holds {n} modules at its top (at most {MAX_MODULES_PER_PACKAGE}: "
                            "zone it into packages)")
    return problems


def folder_graph(internal: dict[str, set[str]], files: dict[str, Path]) -> dict[str, set[str]]:
    """Packages -> the packages they import, at every depth: a module stands for each package that
    holds it (rollout.servers.pool is in rollout.servers and in rollout), and an import between
    two modules is an edge between the innermost packages that tell them apart (rollout.servers ->
    rollout.generation; gspo_megatron -> rollout at the top). An import of a package's own
    __init__ from inside it is not an edge."""
    def chain(m: str) -> list[str]:
        parts = m.split(".")
        pkg_parts = parts if files[m].name == "__init__.py" else parts[:-1]
        return [".".join(pkg_parts[:i]) for i in range(1, len(pkg_parts) + 1)]
    out: dict[str, set[str]] = {}
    for m, deps in internal.items():
        a = chain(m)
        for d in deps:
            b = chain(d)
            i = 0
            while i < len(a) and i < len(b) and a[i] == b[i]:
                i += 1
            if i < len(a) and i < len(b):  # the first packages where the two differ
                out.setdefault(a[i], set()).add(b[i])
    return out


def package_graph() -> dict[str, set[str]]:
    """Second-level packages (gspo_megatron.actor, model_specs, ...) and what they import."""
    internal, _ = graph()

    def pkg(m: str) -> str:
        parts = m.split(".")
        return ".".join(parts[:2]) if parts[0] == "gspo_megatron" and len(parts) > 1 else parts[0]
    out: dict[str, set[str]] = {}
    for m, deps in internal.items():
        out.setdefault(pkg(m), set()).update(pkg(d) for d in deps if pkg(d) != pkg(m))
    return out


def main() -> int:
    for p, deps in sorted(package_graph().items()):
        print(f"{p:28s} -> {', '.join(sorted(deps)) or '-'}")
    problems = violations()
    for p in problems:
        print(f"VIOLATION: {p}")
    print(f"{len(module_files())} modules, {len(problems)} violation(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
