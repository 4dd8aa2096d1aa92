"""Progress bars of more than 8 ranks fold into one aggregated bar (kernel tier, a
dp=10 mesh): the first ranks' displays are emptied, one bar of this kernel says how
far all ranks are together, and the folded ranks' updates stay off IOPub."""

from __future__ import annotations

import pytest
from kernel_helpers import mesh_kernel

pytestmark = pytest.mark.kernel

VIEW = "application/vnd.jupyter.widget-view+json"


@pytest.fixture(scope="module")
def k(tmp_path_factory):
    with mesh_kernel(tmp_path_factory.mktemp("widget-fold"), "dp=10") as kern:
        yield kern


def _said(msgs, text: str) -> bool:
    return any(
        m["msg_type"] == "comm_msg" and m["content"]["data"].get("state", {}).get("value") == text
        for m in msgs
    )


def wait_label(k, msgs, text: str) -> None:
    """The aggregate's label says ``text``: among the cell's messages, or soon after
    (it is redrawn each tick, under whichever request the kernel serves)."""
    if not _said(msgs, text):
        k.collect(lambda groups: any(_said(v, text) for v in groups.values()), timeout=30)


def test_ten_ranks_progress_bars_fold_into_one(k):
    msgs = k.ok(
        "%%monarch\nimport ipywidgets as widgets\np = widgets.IntProgress(max=10)\n"
        "display(p)\np.value = rank",
        timeout=120,
    )
    rank_bars = {
        c["content"]["comm_id"] for c in msgs
        if c["msg_type"] == "comm_open"
        and c["content"]["data"]["state"].get("_model_name") == "IntProgressModel"
    }
    assert len(rank_bars) == 10
    shown = [m for m in msgs if m["msg_type"] == "display_data" and VIEW in m["content"]["data"]]
    per_rank = [m for m in shown if m["content"]["data"][VIEW]["model_id"] in rank_bars]
    assert len(per_rank) == 8  # up to FOLD ranks, then folded
    emptied = {
        m["content"]["transient"]["display_id"] for m in msgs
        if m["msg_type"] == "update_display_data" and m["content"]["data"] == {"text/plain": ""}
    }
    assert emptied == {m["content"]["transient"]["display_id"] for m in per_rank}
    aggregate = [m for m in shown if m["content"]["data"][VIEW]["model_id"] not in rank_bars]
    assert len(aggregate) == 1
    # how far all ranks are together: (0 + 1 + ... + 9) / (10 * 10)
    wait_label(k, msgs, "ranks 0-9: 45 %")
    # the folded bars' own updates are not sent to the frontend
    later = k.ok("%%monarch\np.value = 10")
    assert not [
        m for m in later if m["msg_type"] == "comm_msg" and m["content"]["comm_id"] in rank_bars
    ]
    wait_label(k, later, "ranks 0-9: 100 %")


def test_tqdm_notebook_bars_of_ten_ranks_fold(k):
    msgs = k.ok("%%monarch\nfrom tqdm.notebook import tqdm\nfor i in tqdm(range(5)):\n    pass")
    wait_label(k, msgs, "ranks 0-9: 100 %")
