"""`Table`: the one shape of every extension point, open to rows from outside the package.

    LOSSES = Table("loss", LossSpec, (LossSpec("gspo", ...), ...), field="loss.name")
    LOSSES["gspo"]                        # a shipped row
    LOSSES["my_pkg.losses:CISPO"]         # a row from an installed module, imported on first use
    LOSSES.register(LossSpec("cispo", ...))   # a plug-in module's row (the config's `plugins:`)
    LOSSES.row(name, "loss.name")         # the row, or TableError naming the field and the choices

A table maps names to rows. A name is a row's own name (shipped or registered) or a reference
`package.module:Name` to an object of an installed module: the object is the row (an instance of
the table's row type), or something the table adapts into one (a reward table takes a plain
function). References are imported once and kept under the reference, so `list(LOSSES)` shows
what a run uses. A row may declare its own settings (`settings`, a dataclass: settings.py builds
it from the config's mapping for that row).

Torch-free and import-free: tables are read while the config is checked, before torch loads.
"""
from __future__ import annotations

import contextlib
import importlib
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Generic, TypeVar

from gspo_errors import InputError

R = TypeVar("R")

REFERENCE = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")
"""`package.module:Name` (or `module:Outer.Inner`): what a reference to an installed object looks like."""


TABLES: dict[str, Table] = {}
"""Every table made so far, by what its rows are (a table is made when its module is imported): what
the tests parametrize over."""


class TableError(InputError, ValueError):
    """A name that no row of a table answers to, or a reference that does not import; the message
    reads `field=value: ...` so that the config can name its section."""


def is_reference(name: str) -> bool:
    """`name` has the shape of `package.module:Name` (a URL or a plain name has not)."""
    return bool(REFERENCE.match(name))


def load_object(reference: str, field: str = "reference") -> object:
    """The object `package.module:Name` names, imported; TableError says what failed."""
    if not is_reference(reference):
        raise TableError(f"{field}={reference!r}: expected package.module:Name")
    module_name, _, attr = reference.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 - any failure while importing is the plug-in module's
        raise TableError(f"{field}={reference!r}: cannot import {module_name!r} "
                         f"({type(e).__name__}: {e})") from None
    obj: object = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise TableError(f"{field}={reference!r}: module {module_name!r} has no {attr!r}")
        obj = getattr(obj, part)
    return obj


def import_plugins(modules: Sequence[str], field: str = "plugins") -> None:
    """Import each plug-in module (once: Python caches modules); a module registers its rows in the
    tables as it is imported. TableError names the entry that failed."""
    for i, name in enumerate(modules):
        if not isinstance(name, str) or not re.match(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$", name):
            raise TableError(f"{field}[{i}]={name!r}: expected a module name, e.g. my_pkg.gspo_plugins")
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - the plug-in module's own failure, named
            raise TableError(f"{field}[{i}]={name!r}: cannot import it ({type(e).__name__}: {e})") from None


class Table(Mapping[str, R], Generic[R]):
    """Rows by name (module docstring). Iteration, `len` and `in` see the rows registered so far and
    the references loaded; `row()` and `[]` also load a reference on first use."""

    def __init__(self, what: str, row_type: type | tuple[type, ...], rows: Iterable[R] = (), *,
                 field: str = "", name_of: Callable[[R], str] = lambda row: row.name,  # type: ignore[attr-defined]
                 description_of: Callable[[R], str] = lambda row: row.description,  # type: ignore[attr-defined]
                 adapt: Callable[[object, str], R | None] | None = None, kind: str = "") -> None:
        """adapt(obj, reference): a row made of an object a reference names that is not a row (a
        reward table takes a plain function), or None when it cannot be one."""
        self.what = what
        """What a row is, for messages: "loss", "advantage estimator", ..."""
        self.row_type = row_type
        self.field = field
        """The config field whose value names a row (its messages' default field)."""
        self._name_of, self._description_of, self._adapt = name_of, description_of, adapt
        self._kind = kind
        """What a reference must name, for messages (default: the row type's name)."""
        self._rows: dict[str, R] = {}
        self._references: set[str] = set()
        for row in rows:
            self.register(row)
        TABLES[what] = self

    # --- what a plug-in module calls ------------------------------------------------------------
    def register(self, row: R) -> R:
        """Add a row under its own name (a plug-in module calls this as it is imported; returns the
        row, so a class can be registered with a decorator). The same object twice is a no-op;
        another row under a taken name is refused."""
        if not self._is_row(row):
            raise TableError(f"{row!r} is not a {self.what} (expected a {self._type_names()})")
        checked = row
        name = self._name_of(checked)
        if not isinstance(name, str) or not name or is_reference(name):
            raise TableError(f"a {self.what} row's name={name!r}: expected a plain name (not module:Name)")
        if name in self._rows and self._rows[name] is not checked:
            raise TableError(f"{self.what} {name!r} is registered twice (the second: {checked!r})")
        self._rows[name] = checked
        return row

    @contextlib.contextmanager
    def registered(self, row: R) -> Iterator[R]:
        """`row` registered for the duration of a `with` block, then removed (tests add rows this way)."""
        self.register(row)
        try:
            yield row
        finally:
            self._rows.pop(self._name_of(row), None)

    # --- lookups --------------------------------------------------------------------------------
    def row(self, name: str, field: str | None = None, choose: Callable[[R], bool] | None = None) -> R:
        """The row `name` answers to: a registered name, or a reference imported now; TableError
        names the field, the value and the choices (those rows for which `choose` is true)."""
        field = field or self.field or self.what
        row = self._find(name, field, choose)
        if choose is not None and not choose(row):
            raise self._unknown(name, field, choose)
        return row

    def _find(self, name: str, field: str, choose: Callable[[R], bool] | None) -> R:
        if name in self._rows:
            return self._rows[name]
        if isinstance(name, str) and is_reference(name):
            obj = load_object(name, field)
            row = obj if self._is_row(obj) else (self._adapt(obj, name) if self._adapt is not None else None)
            if row is None:
                raise TableError(f"{field}={name!r}: {obj!r} is not a {self.what} (expected a "
                                 f"{self._type_names()})")
            self._rows[name] = row  # type: ignore[assignment]
            self._references.add(name)
            return row  # type: ignore[return-value]
        raise self._unknown(name, field, choose)

    def _unknown(self, name: str, field: str, choose: Callable[[R], bool] | None) -> TableError:
        named = [n for n, row in self._rows.items() if n not in self._references and (choose is None or choose(row))]
        return TableError(f"{field}={name!r}: expected one of {', '.join(named)}, or "
                          f"package.module:Name naming a {self._type_names()}")

    def __getitem__(self, name: str) -> R:
        try:
            return self.row(name)
        except TableError:
            raise KeyError(name) from None

    def __contains__(self, name: object) -> bool:
        if not isinstance(name, str):
            return False
        try:
            self.row(name)
        except TableError:
            return False
        return True

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._rows))

    def __len__(self) -> int:
        return len(self._rows)

    def choices(self, references: bool = True) -> dict[str, str]:
        """{name: one-line description} of every row (what `gspo-megatron config` lists); without the
        rows loaded by reference when `references` is False (what the docs show)."""
        return {name: self._description_of(row) for name, row in self._rows.items()
                if references or name not in self._references}

    def names_text(self) -> str:
        """The names for a message or a docstring: `a, b or c`."""
        names = list(self._rows)
        return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"

    # --- internals ------------------------------------------------------------------------------
    def _is_row(self, obj: object) -> bool:
        return isinstance(obj, self.row_type)

    def _type_names(self) -> str:
        if self._kind:
            return self._kind
        types = self.row_type if isinstance(self.row_type, tuple) else (self.row_type,)
        return " or ".join(t.__name__ for t in types)
