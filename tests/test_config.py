"""One configuration (monarch_nb/config.py): a keyword, %config or a MONARCH_NB_*
variable sets each setting; a mesh reads them once and hands them to its ranks; bad
values, typos and restart-needing changes are refused naming the setting."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from kernel_helpers import Kernel, errors_text, stream, text

import monarch_nb as mnb
from monarch_nb import config
from monarch_nb.config import ConfigError

API = Path(__file__).resolve().parents[1] / "docs" / "api.md"


@pytest.fixture
def clean_settings():
    """The process's settings object as a test leaves it: nothing set on it."""
    own = config.settings()
    yield own
    for name in list(own.set_here):
        own.set_here.discard(name)


@pytest.mark.unit
def test_a_keyword_beats_a_setting_which_beats_a_variable_which_beats_the_default(
    monkeypatch, clean_settings
):
    env = {}
    assert config.snapshot(env)["stall_seconds"] == 30.0
    env["MONARCH_NB_STALL_SECONDS"] = "7"
    assert config.snapshot(env)["stall_seconds"] == 7.0
    clean_settings.stall_seconds = 9
    assert config.snapshot(env)["stall_seconds"] == 9.0
    assert config.snapshot(env, stall_seconds=11)["stall_seconds"] == 11.0
    assert config.process_env({"sign_full": True, "stall_seconds": 2.5}) == {
        "MONARCH_NB_SIGN_FULL": "1",
        "MONARCH_NB_STALL_SECONDS": "2.5",
    }


@pytest.mark.unit
@pytest.mark.parametrize(
    "env, message",
    [
        ({"MONARCH_NB_HEARTBEAT_TIMOUT": "3"}, "MONARCH_NB_HEARTBEAT_TIMOUT is not a monarch_nb "
         "setting (did you mean MONARCH_NB_HEARTBEAT_TIMEOUT"),
        ({"MONARCH_NB_HEARTBEAT_TIMEOUT": "soon"}, "MONARCH_NB_HEARTBEAT_TIMEOUT='soon': a number > 0"),
        ({"MONARCH_NB_HEARTBEAT_TIMEOUT": "0"}, "must be > 0, got 0.0"),
        ({"MONARCH_NB_SPAWN": "fork"}, "MONARCH_NB_SPAWN='fork': one of agent, popen"),
        ({"MONARCH_NB_SIGN_FULL": "yes"}, "MONARCH_NB_SIGN_FULL='yes': 0 or 1"),
        ({"MONARCH_NB_TIMELINE_SIZE": "-5"}, "MONARCH_NB_TIMELINE_SIZE='-5': an integer >= 0"),
        ({"MONARCH_NB_INTERRUPT_WAIT": "-1"}, "MONARCH_NB_INTERRUPT_WAIT='-1': a number > 0"),
    ],
)  # fmt: skip
def test_bad_variables_are_refused_naming_the_setting_and_what_it_takes(env, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        config.snapshot(env)


@pytest.mark.unit
def test_one_setting_read_later_ignores_other_variables(clean_settings):
    """A mesh checks every variable at its start; a setting read later (at a Ctrl-C,
    a progress bar) reads its own only: a typo set since cannot fail the interrupt."""
    env = {"MONARCH_NB_INTERRUPT_WAIT": "2.5", "MONARCH_NB_STAL_SECONDS": "1"}
    assert config.setting("interrupt_wait", env) == 2.5
    with pytest.raises(ConfigError, match="MONARCH_NB_STAL_SECONDS is not"):
        config.snapshot(env)
    clean_settings.interrupt_wait = 1.5  # %config wins over the variable
    assert config.setting("interrupt_wait", env) == 1.5


@pytest.mark.unit
def test_a_keyword_of_the_wrong_type_is_refused(clean_settings):
    with pytest.raises(ConfigError, match=r"heartbeat_timeout='soon': a number > 0"):
        config.snapshot({}, heartbeat_timeout="soon")
    with pytest.raises(Exception, match="expected a float"):
        clean_settings.heartbeat_timeout = "soon"
    assert "heartbeat_timeout" not in clean_settings.set_here  # nothing half-set


@pytest.mark.unit
def test_the_table_in_api_md_is_the_codes():
    assert config.markdown_table() in API.read_text(), (
        "docs/api.md's settings table is stale: paste `python -m monarch_nb.config`"
    )


def test_a_mesh_hands_its_settings_to_its_ranks_and_refuses_a_typo(monkeypatch, clean_settings):
    clean_settings.stall_seconds = 12.5  # as %config would: not in this process's env
    monkeypatch.setenv("MONARCH_NB_COLLECTIVE_TIMEOUT", "77")
    with mnb.local_mesh(dp=2, name="configured", heartbeat_timeout=4) as m:

        def read():
            from monarch_nb.config import process_settings

            s = process_settings()
            return s["stall_seconds"], s["collective_timeout"], s["heartbeat_timeout"]

        assert mnb.remote(read)(mesh=m).fetch(timeout=60) == [(12.5, 77.0, 4.0)] * 2
        assert m._controller.liveness.heartbeat_timeout == 4.0
        with pytest.raises(Exception, match="needs a restart: the running mesh"):
            clean_settings.stall_seconds = 3  # the mesh read it at its start
        assert m.pull("rank") == [0, 1]  # and it serves on
    monkeypatch.setenv("MONARCH_NB_STAL_SECONDS", "1")
    with pytest.raises(ConfigError, match="MONARCH_NB_STAL_SECONDS is not a monarch_nb setting"):
        mnb.local_mesh(dp=1, name="typo")
    assert "typo" not in mnb.api.mesh.all_meshes()


@pytest.mark.kernel
def test_percent_config_in_a_kernel(tmp_path):
    k = Kernel(tmp_path)
    try:
        k.ok("%load_ext monarch_nb\nimport monarch_nb as mnb")
        listed = text(k.ok("%config MonarchNB"))
        assert "heartbeat_timeout" in listed and "MonarchNB." in listed
        k.ok("%config MonarchNB.stall_seconds = 6.5")
        assert k.value("mnb.config.snapshot()['stall_seconds']") == 6.5
        msgs = k.ok("%config MonarchNB.stall_seconds = 'soon'")  # %config shows the error
        assert "expected a float" in text(msgs) + errors_text(msgs)
        k.ok("%monarch_mesh dp=1", timeout=120)
        code = "from monarch_nb.config import process_settings as p; print(p()['stall_seconds'])"
        msgs = k.ok(f"%%monarch\n{code}", timeout=60)
        assert "6.5" in text(msgs)
        msgs = k.ok("%config MonarchNB.stall_seconds = 3")
        said = text(msgs) + errors_text(msgs) + stream(msgs, "stderr")
        assert "needs a restart" in said and "default" in said
        assert k.value("mnb.config.snapshot()['stall_seconds']") == 6.5
        k.ok("%monarch_mesh --shutdown")
        k.ok("%config MonarchNB.stall_seconds = 3")
        assert k.value("mnb.config.snapshot()['stall_seconds']") == 3.0
    finally:
        k.shutdown()
