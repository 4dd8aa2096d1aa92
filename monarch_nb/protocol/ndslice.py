"""NDSlice: an N-d slice of global ranks (offset, sizes, strides). Pure math."""

from __future__ import annotations

import itertools
from typing import NamedTuple


class NDSlice(NamedTuple):
    """rank = offset + sum(coord[i] * strides[i]) for 0 <= coord[i] < sizes[i]."""

    offset: int
    sizes: tuple
    strides: tuple

    @classmethod
    def contiguous(cls, sizes) -> NDSlice:
        sizes = tuple(int(s) for s in sizes)
        strides, acc = [], 1
        for s in reversed(sizes):
            strides.append(acc)
            acc *= s
        return cls(0, sizes, tuple(reversed(strides)))

    def __len__(self) -> int:  # type: ignore[override]
        n = 1
        for s in self.sizes:
            n *= s
        return n

    def ranks(self) -> list:
        return [
            self.offset + sum(c * st for c, st in zip(coord, self.strides))
            for coord in itertools.product(*(range(s) for s in self.sizes))
        ]

    def coordinates(self, rank: int) -> tuple | None:
        """The coordinates of ``rank`` in this slice, or None if it is not a member."""
        rest = rank - self.offset
        # strides may be in any order: peel the largest first
        order = sorted(range(len(self.sizes)), key=lambda i: -self.strides[i])
        coords = [0] * len(self.sizes)
        for i in order:
            st = self.strides[i]
            c = rest // st if st else 0
            if not 0 <= c < self.sizes[i]:
                return None
            coords[i] = c
            rest -= c * st
        return tuple(coords) if rest == 0 else None

    def rank_at(self, coords) -> int:
        return self.offset + sum(c * st for c, st in zip(coords, self.strides))

    def groups(self, reduced: tuple) -> list:
        """Partition the ranks into groups that differ only along the dims with
        indices ``reduced``; members in row-major order of those dims."""
        kept = [i for i in range(len(self.sizes)) if i not in reduced]
        out = []
        for kc in itertools.product(*(range(self.sizes[i]) for i in kept)):
            members = []
            for rc in itertools.product(*(range(self.sizes[i]) for i in reduced)):
                coords = [0] * len(self.sizes)
                for i, c in zip(kept, kc):
                    coords[i] = c
                for i, c in zip(reduced, rc):
                    coords[i] = c
                members.append(self.rank_at(coords))
            out.append(tuple(members))
        return out
