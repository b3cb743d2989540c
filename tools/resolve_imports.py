"""Every import of the project's own packages resolves: the module exists and every name imported
from it is in it, the imports inside functions included. A GPU-only path runs its function-level
imports only on a GPU, so without this a module that a move renamed shows first on a GPU visit.

    python tools/resolve_imports.py                                # every .py of WALKED; exit 1 on any
    python tools/resolve_imports.py tools/gpu_check.py --follow    # a tool and every own module it reaches

Each module is imported once. A module that cannot be imported on this machine for a reason that
is not ours (no CUDA, no Transformer Engine, a package this machine lacks) is resolved from its
source instead (its top-level names, those under `if TYPE_CHECKING:` and in try blocks included)
and named in the report, never passed over. A name imported under `if TYPE_CHECKING:` may be one
its module defines only there (a type alias); imported at run time, it must exist at run time.
"""
from __future__ import annotations

import argparse
import ast
import importlib
import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OWN = ("gspo_errors", "gspo_megatron", "model_specs", "rollout", "tools", "benchmarks")
WALKED = (*OWN, "launch", "scripts")


@dataclass(frozen=True)
class Import:
    path: Path
    line: int
    module: str              # absolute, relative imports resolved
    names: tuple[str, ...]   # empty for `import module`
    type_checking: bool      # under `if TYPE_CHECKING:`: never runs

    def text(self) -> str:
        return f"from {self.module} import {', '.join(self.names)}" if self.names else f"import {self.module}"


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _module_of(path: Path) -> list[str]:
    """The dotted parts of a file's module, from the nearest folder of sys.path above it."""
    path = path.resolve()
    for entry in [ROOT, *map(Path, filter(None, sys.path))]:
        try:
            parts = list(path.relative_to(entry.resolve()).with_suffix("").parts)
        except ValueError:
            continue
        return parts[:-1] if parts[-1] == "__init__" else parts
    return [path.stem]


def imports_of(path: Path, own: tuple[str, ...] = OWN) -> list[Import]:
    """Every import of an own package in `path`, at any depth (functions, classes, branches)."""
    tree = ast.parse(path.read_text(errors="replace"), str(path))
    here = _module_of(path)
    package = here if path.name == "__init__.py" else here[:-1]
    out: list[Import] = []
    todo: list[tuple[ast.AST, bool]] = [(tree, False)]
    while todo:
        node, tc = todo.pop()
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            todo += [(n, True) for n in node.body] + [(n, tc) for n in node.orelse]
            continue
        if isinstance(node, ast.Import):
            out += [Import(path, node.lineno, a.name, (), tc) for a in node.names if a.name.split(".")[0] in own]
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            if module.split(".")[0] in own:
                out.append(Import(path, node.lineno, module, tuple(a.name for a in node.names if a.name != "*"), tc))
        todo += [(n, tc) for n in ast.iter_child_nodes(node)]
    return sorted(out, key=lambda i: i.line)


def source_of(module: str) -> Path | None:
    """The file of an own module, found without importing it."""
    rel = Path(*module.split("."))
    for entry in [ROOT, *map(Path, filter(None, sys.path))]:
        for f in (entry / rel.with_suffix(".py"), entry / rel / "__init__.py"):
            if f.is_file():
                return f
    return None


def defined_names(path: Path) -> set[str]:
    """The names a module's source defines at its top level: under if / try / with blocks too, and
    the keys of an `_EXPORTS` table (a package whose __getattr__ imports them on first use)."""
    names: set[str] = set()
    todo = list(ast.parse(path.read_text(errors="replace")).body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
            if any(isinstance(t, ast.Name) and t.id == "_EXPORTS" for t in targets) and \
                    isinstance(node.value, ast.Dict):
                names |= {k.value for k in node.value.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            todo += [n for n in ast.iter_child_nodes(node) if isinstance(n, ast.stmt)]
            if isinstance(node, ast.Try):
                todo += [n for h in node.handlers for n in h.body]
    return names


@dataclass
class Resolver:
    """Imports each own module once and says, per import, what does not resolve."""
    own: tuple[str, ...] = OWN
    loaded: dict[str, object] = field(default_factory=dict)       # module -> module or its exception
    from_source: dict[str, str] = field(default_factory=dict)     # module -> why it cannot import here

    def load(self, module: str) -> object:
        if module not in self.loaded:
            try:
                self.loaded[module] = importlib.import_module(module)
            except (Exception, SystemExit) as e:  # noqa: BLE001 - the failure is what is reported
                self.loaded[module] = e
        return self.loaded[module]

    def ours(self, e: BaseException) -> bool:
        """An import failure of ours: an own module or name missing, or an error raised by our code
        (not by a package this machine lacks or a device it has not)."""
        if isinstance(e, ImportError):
            return (e.name or "").split(".")[0] in self.own
        frames = [f for f in traceback.extract_tb(e.__traceback__) if not f.filename.startswith("<")]
        if not frames:
            return False
        raised_in = Path(frames[-1].filename).resolve()
        ours = [ROOT / d for d in WALKED] + [f.parent for p in self.own if (f := source_of(p)) is not None]
        return any(raised_in.is_relative_to(d.resolve()) for d in ours)

    def is_module(self, module: str) -> bool:
        got = self.load(module)
        if not isinstance(got, BaseException):
            return True
        if self.ours(got):
            return False
        self.from_source.setdefault(module, f"{type(got).__name__}: {str(got).splitlines()[0][:120]}")
        return source_of(module) is not None

    def problems(self, imp: Import) -> list[str]:
        where = f"{imp.path.relative_to(ROOT) if imp.path.is_relative_to(ROOT) else imp.path}:{imp.line}"
        got = self.load(imp.module)
        failed = isinstance(got, BaseException)
        if failed and not self.is_module(imp.module):  # else it is resolved from its source
            return [f"{where}: {imp.text()}: {type(got).__name__}: {str(got).splitlines()[0]}"]
        src = source_of(imp.module)
        static = defined_names(src) if src and (failed or imp.type_checking) else set()
        return [f"{where}: {imp.text()}: {imp.module} has no {name!r}" for name in imp.names
                if not ((not failed and hasattr(got, name)) or name in static
                        or (source_of(f"{imp.module}.{name}") and self.is_module(f"{imp.module}.{name}")))]

    def check(self, paths: list[Path], follow: bool = False) -> list[str]:
        """The problems of `paths`' imports; with `follow`, of every own module they reach too."""
        out, seen, todo = [], set(), [p.resolve() for p in paths]
        while todo:
            path = todo.pop(0)
            if path in seen:
                continue
            seen.add(path)
            for imp in imports_of(path, self.own):
                out += self.problems(imp)
                if follow:
                    todo += [f.resolve() for m in (imp.module, *(f"{imp.module}.{n}" for n in imp.names))
                             if (f := source_of(m)) is not None]
        return out


def walked_files(root: Path = ROOT) -> list[Path]:
    return sorted(p for d in WALKED for p in (root / d).rglob("*.py") if "__pycache__" not in p.parts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("paths", nargs="*", type=Path, help="files to check (default: every .py of WALKED)")
    ap.add_argument("--follow", action="store_true", help="also every own module the files reach")
    ap.add_argument("--own", action="append", default=[], help="one more top-level package to count as own")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from gspo_megatron.run.expected_warnings import quiet_expected_warnings
    quiet_expected_warnings()  # megatron-core's lines at import on a CPU
    resolver = Resolver(own=(*OWN, *args.own))
    paths = args.paths or walked_files()
    problems = resolver.check(paths, follow=args.follow)
    for module, why in sorted(resolver.from_source.items()):
        print(f"resolved from its source, not importable here ({why}): {module}")
    print("\n".join(problems))
    print(f"{len(problems)} unresolved imports of own packages in {len(paths)} files"
          f"{' and the modules they reach' if args.follow else ''}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
