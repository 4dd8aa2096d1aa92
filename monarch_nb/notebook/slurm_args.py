"""``%monarch_mesh --slurm nodes=4 ranks_per_node=2 ...``: the KEY=VALUE words of
the magic read as ``mnb.slurm_mesh``'s keywords."""

from __future__ import annotations

from IPython.core.error import UsageError

INTS = ("nodes", "ranks_per_node", "gpus")
TEXTS = ("partition", "time", "account")


def parse_slurm(tokens: list[str]) -> dict:
    """``["nodes=4", "gpus=2", "partition=gpu"]`` -> slurm_mesh's keywords (with
    ``gpus`` and no ``ranks_per_node``: a rank per GPU); UsageError naming a bad word."""
    kw: dict = {}
    for tok in tokens:
        key, eq, value = tok.partition("=")
        if not eq or key not in INTS + TEXTS:
            raise UsageError(
                f"%monarch_mesh --slurm: unexpected {tok!r}: write KEY=VALUE, KEY one of "
                f"{', '.join(INTS + TEXTS)} (e.g. %monarch_mesh --slurm nodes=4 ranks_per_node=2)"
            )
        if key in INTS:
            try:
                kw[key] = int(value)
            except ValueError:
                raise UsageError(
                    f"%monarch_mesh --slurm: {key} must be an int, got {value!r}"
                ) from None
        else:
            kw[key] = value
    if kw.get("gpus") and "ranks_per_node" not in kw:
        kw["ranks_per_node"] = kw["gpus"]
    return kw
