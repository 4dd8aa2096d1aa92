"""Named hooks: a slot a higher layer (or the worker) fills, so a lower layer calls
up without importing it. Each hook is a module-level ``Hook`` with a NAME in
capitals: grep ``NAME.install`` to find who fills it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class Hook:
    """One slot: ``install(value)`` fills it, ``get()`` reads it (``None`` when empty
    and no loader is installed), ``require()`` reads it or raises naming the hook."""

    __slots__ = ("name", "doc", "value", "loader")

    def __init__(self, name: str, doc: str):
        self.name, self.doc = name, doc
        self.value: Any = None
        self.loader: Callable[[], None] | None = None

    def install(self, value) -> None:
        """Fill the slot (``None`` empties it)."""
        self.value = value

    def install_loader(self, load: Callable[[], None]) -> None:
        """``load()`` fills the slot on first ``get`` (an import that installs it)."""
        self.loader = load

    def get(self):
        if self.value is None and self.loader is not None:
            self.loader()
        return self.value

    def require(self, why: str):
        """The installed value; a RuntimeError naming the hook and ``why`` if empty."""
        value = self.get()
        if value is None:
            raise RuntimeError(f"{why} (hook {self.name!r}: {self.doc}, is not installed)")
        return value

    def __repr__(self) -> str:
        state = "empty" if self.value is None else f"= {self.value!r}"
        return f"<Hook {self.name} {state}>"
