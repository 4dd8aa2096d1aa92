"""The import-linter layers contracts for the inside of each folder of monarch_nb,
from today's imports: each module sits one layer above the highest module it
imports, so no circle can form (a module imports only modules of lower layers, or
of its own, ``:``). pyproject.toml holds them between its BEGIN/END lines; after
adding a module or an import that goes up, rewrite them:

    python scripts/layer_contracts.py --write
"""

from __future__ import annotations

import sys
from pathlib import Path

import grimp

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"
BEGIN = "# BEGIN the folders' insides"
END = "# END the folders' insides"

FOLDERS = ["api", "api.tensor", "launchers", "controller", "host", "worker", "protocol", "notebook", "ui"]


def levels(graph, folder: str) -> list[list[str]]:
    full = f"monarch_nb.{folder}"
    depth = full.count(".") + 1
    mods = sorted(m for m in graph.modules if m.startswith(full + ".") and m.count(".") == depth)

    def owner(d):
        return next((m for m in mods if d == m or d.startswith(m + ".")), None)

    deps = {m: {o for d in graph.find_modules_directly_imported_by(m) if (o := owner(d)) not in (None, m)} for m in mods}
    level: dict[str, int] = {}

    def of(m, seen=()):
        if m not in level:
            if m in seen:
                raise SystemExit(f"a circle: {' -> '.join(seen + (m,))}")
            level[m] = 1 + max((of(d, seen + (m,)) for d in deps[m]), default=-1)
        return level[m]

    for m in mods:
        of(m)
    rows = [sorted(m.rsplit(".", 1)[1] for m in mods if level[m] == k) for k in range(max(level.values()) + 1)]
    return rows[::-1]


def contracts() -> str:
    graph = grimp.build_graph("monarch_nb", exclude_type_checking_imports=True)
    out = []
    for folder in FOLDERS:
        if folder == "api":
            continue  # written by hand in pyproject.toml: its layers have names
        out += [
            "[[tool.importlinter.contracts]]",
            f'name = "Inside {folder.replace(".", "/")}/: each module imports only those below it"',
            'type = "layers"',
            f'containers = ["monarch_nb.{folder}"]',
            "exhaustive = true",
            "layers = [",
            *(f'    "{" : ".join(row)}",' for row in levels(graph, folder)),
            "]",
            "",
        ]
    return "\n".join(out)


def main() -> None:
    text = contracts()
    if "--write" not in sys.argv[1:]:
        print(text)
        return
    old = PYPROJECT.read_text()
    head, rest = old.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    first_line = rest.split("\n", 1)[0]
    PYPROJECT.write_text(f"{head}{BEGIN}{first_line}\n{text}{END}{tail}")


if __name__ == "__main__":
    main()
