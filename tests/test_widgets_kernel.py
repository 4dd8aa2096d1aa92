"""ipywidgets made on the ranks, live in the notebook (kernel tier): each rank's comm
is opened in the frontend before the display that names its model, a change on the
rank reaches the frontend, and what the frontend sends reaches the rank's widget."""

from __future__ import annotations

import time

import pytest
from kernel_helpers import displays, errors_text, idle, mesh_kernel, stream

pytestmark = pytest.mark.kernel

VIEW = "application/vnd.jupyter.widget-view+json"


@pytest.fixture(scope="module")
def k(tmp_path_factory):
    with mesh_kernel(tmp_path_factory.mktemp("widgets")) as kern:
        yield kern


def _comms(msgs, msg_type: str) -> list[dict]:
    return [m["content"] for m in msgs if m["msg_type"] == msg_type]


def _send_to_comm(k, msg_type: str, comm_id: str, data: dict) -> None:
    """What the browser sends to a comm, on the shell channel."""
    msg = k.kc.session.msg(msg_type, {"comm_id": comm_id, "data": data})
    k.kc.shell_channel.send(msg)


def _wait_iopub(k, pred, timeout: float = 30) -> dict:
    deadline = time.monotonic() + timeout
    seen = []
    while time.monotonic() < deadline:
        try:
            msg = k.kc.get_iopub_msg(timeout=0.5)
        except Exception:
            continue
        seen.append(msg["msg_type"])
        if pred(msg):
            return msg
    raise TimeoutError(f"no such IOPub message in {timeout} s; got {seen}")


def _ranks_by_comm(msgs) -> dict:
    """comm_id -> the rank whose display names it (each rank shows its own)."""
    return {d[VIEW]["model_id"]: d for d in displays(msgs) if VIEW in d}


def test_a_slider_on_each_rank_is_a_live_widget(k):
    msgs = k.ok(
        "%%monarch\nimport ipywidgets as widgets\nw = widgets.IntSlider(value=1)\nw",
        timeout=90,
    )
    opened = [c for c in _comms(msgs, "comm_open") if c["target_name"] == "jupyter.widget"]
    models = {c["comm_id"]: c for c in opened if c["data"]["state"]["_model_name"] == "IntSliderModel"}
    assert len(models) == 2, opened  # one per rank
    assert {c["data"]["state"]["value"] for c in models.values()} == {1}
    shown = _ranks_by_comm(msgs)
    assert set(shown) == set(models), (shown, models)
    # every comm is opened before the display that names it
    order = [m["msg_type"] for m in msgs]
    assert max(i for i, t in enumerate(order) if t == "comm_open") < order.index("display_data")

    # a change on the ranks reaches the frontend
    msgs = k.ok("%%monarch\nw.value = 5")
    updates = [
        c for c in _comms(msgs, "comm_msg")
        if c["comm_id"] in models and c["data"].get("method") == "update"
    ]
    assert {c["comm_id"] for c in updates} == set(models)
    assert all(c["data"]["state"] == {"value": 5} for c in updates)

    # the frontend moves rank 0's slider: the rank's widget takes the value
    rank_ids = _rank_comm_ids(k)
    _send_to_comm(
        k, "comm_msg", rank_ids[0],
        {"method": "update", "state": {"value": 7}, "buffer_paths": []},
    )
    _wait_iopub(  # ipywidgets echoes what it took
        k,
        lambda m: m["msg_type"] == "comm_msg"
        and m["content"]["comm_id"] == rank_ids[0]
        and m["content"]["data"].get("method") == "echo_update",
    )
    msgs = k.ok("%%monarch\nprint(w.value)")
    out = stream(msgs)
    assert "[rank 0] 7" in out and "[rank 1] 5" in out, out


def _rank_comm_ids(k) -> list[str]:
    """The model id of ``w`` on each rank, read on the ranks."""
    msgs = k.ok("%%monarch\nprint('model', w.model_id)")
    out = stream(msgs)
    ids = {}
    for line in out.splitlines():
        head, _, rest = line.partition("] model ")
        if rest:
            ids[int(head.rsplit(" ", 1)[1])] = rest.strip()
    assert sorted(ids) == [0, 1], out
    return [ids[0], ids[1]]


def test_a_button_click_runs_its_callback_on_the_rank(k):
    k.ok(
        "%%monarch\nimport ipywidgets as widgets\nclicks = []\n"
        "b = widgets.Button(description='go')\n"
        "b.on_click(lambda _: (clicks.append(1), print('clicked on', rank)))\n"
        "print('model', b.model_id)\nb"
    )
    msgs = k.ok("%%monarch\nprint('model', b.model_id)")
    ids = [line.split("model ")[1] for line in stream(msgs).splitlines() if "model " in line]
    for comm_id in ids:
        _send_to_comm(k, "comm_msg", comm_id, {"method": "custom", "content": {"event": "click"}})
    # what the callbacks print is the mesh's output (under the request the kernel serves)
    k.collect(
        lambda groups: all(
            f"clicked on {r}" in stream(sum(groups.values(), [])) for r in (0, 1)
        ),
        timeout=30,
    )
    deadline = time.monotonic() + 30
    while True:  # the widget thread runs the callback soon after
        out = stream(k.ok("%%monarch\nprint(len(clicks))"))
        if "[ranks 0-1] 1" in out or time.monotonic() > deadline:
            break
    assert "[ranks 0-1] 1" in out, out


def test_a_widget_whose_frontend_closes_is_dropped_and_the_mesh_serves(k):
    msgs = k.ok("%%monarch\nimport ipywidgets as widgets\np = widgets.IntProgress(max=10)\np")
    models = [
        c["comm_id"] for c in _comms(msgs, "comm_open")
        if c["data"]["state"]["_model_name"] == "IntProgressModel"
    ]
    assert len(models) == 2
    for comm_id in models:
        _send_to_comm(k, "comm_close", comm_id, {})
    deadline = time.monotonic() + 30
    while True:  # the ranks learn it: their changes no longer travel
        msgs = k.ok("%%monarch\np.value += 1\nprint(p.comm._closed)")
        sent = [c for c in _comms(msgs, "comm_msg") if c["comm_id"] in models]
        if "[ranks 0-1] True" in stream(msgs) or time.monotonic() > deadline:
            break
    assert "[ranks 0-1] True" in stream(msgs), stream(msgs) + errors_text(msgs)
    msgs = k.ok("%%monarch\np.value += 1\nprint('served', p.value)")
    sent = [c for c in _comms(msgs, "comm_msg") if c["comm_id"] in models]
    assert sent == []
    assert "served" in stream(msgs)


def test_a_displayed_progress_bar_is_seen_while_its_cell_runs(k, tmp_path):
    flag = tmp_path / "go"
    code = (
        "%%monarch\nimport os, time, ipywidgets as widgets\n"
        "p = widgets.IntProgress(max=10)\ndisplay(p)\np.value = 3\n"
        f"while not os.path.exists({str(flag)!r}):\n    time.sleep(0.02)\n"
        "p.value = 10\n"
    )
    msg_id = k.kc.execute(code, allow_stdin=False)
    shown = k.drain(msg_id, lambda ms: len([m for m in ms if m["msg_type"] == "display_data"
                                            and VIEW in m["content"]["data"]]) >= 2, timeout=60)
    # both ranks' bars are on the page while the cell still runs, their comms first
    opened = {c["comm_id"] for c in _comms(shown, "comm_open")}
    views = {m["content"]["data"][VIEW]["model_id"] for m in shown
             if m["msg_type"] == "display_data" and VIEW in m["content"]["data"]}
    assert views <= opened and len(views) == 2
    flag.write_text("")
    rest = k.drain(msg_id, idle, timeout=60)
    done = [c for c in _comms(rest, "comm_msg")
            if c["comm_id"] in views and c["data"].get("state", {}).get("value") == 10]
    assert {c["comm_id"] for c in done} == views


@pytest.mark.parametrize("module", ["tqdm.notebook", "tqdm.auto"])
def test_tqdm_notebook_bars_render_as_widgets_one_per_rank(k, module):
    # tqdm.auto picks its notebook bar on a rank too: a rank's cell is a notebook cell
    msgs = k.ok(f"%%monarch\nfrom {module} import tqdm\nfor i in tqdm(range(4), desc='steps'):\n    pass")
    assert "steps" not in stream(msgs, "stderr")  # not the text bar
    bars = {
        c["comm_id"] for c in _comms(msgs, "comm_open")
        if c["data"]["state"]["_model_name"] == "FloatProgressModel"
    }
    assert len(bars) == 2  # one per rank
    boxes = {
        c["comm_id"] for c in _comms(msgs, "comm_open")
        if c["data"]["state"]["_model_name"] == "HBoxModel"
    }
    views = {m["content"]["data"][VIEW]["model_id"] for m in msgs
             if m["msg_type"] == "display_data" and VIEW in m["content"]["data"]}
    assert views == boxes and len(views) == 2
    finished = {
        c["comm_id"] for c in _comms(msgs, "comm_msg")
        if c["comm_id"] in bars and c["data"].get("state", {}).get("value") == 4
    }
    assert finished == bars
