"""Print import-linter layers contracts for the inside of each folder of monarch_nb,
from today's imports: each module sits one layer above the highest module it
imports. pyproject.toml holds the result; run this to place a new module:

    python scripts/layer_contracts.py
"""

from __future__ import annotations

import grimp

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


def main() -> None:
    graph = grimp.build_graph("monarch_nb", exclude_type_checking_imports=True)
    for folder in FOLDERS:
        if folder == "api":
            continue  # written by hand in pyproject.toml: its layers have names
        print("[[tool.importlinter.contracts]]")
        print(f'name = "Inside {folder.replace(".", "/")}/: each module imports only those below it"')
        print('type = "layers"')
        print(f'containers = ["monarch_nb.{folder}"]')
        print("exhaustive = true")
        print("layers = [")
        for row in levels(graph, folder):
            print(f'    "{" : ".join(row)}",')
        print("]\n")


if __name__ == "__main__":
    main()
