"""monarch_nb's settings, in one place: ``MonarchNB``, a traitlets Configurable (the
way Jupyter configures its parts).

A setting is given, first match wins, by a keyword argument of the mesh
(``local_mesh(heartbeat_timeout=30)``), by ``%config MonarchNB.heartbeat_timeout = 30``
(or ``mnb.config.settings().heartbeat_timeout = 30``), or by its ``MONARCH_NB_*``
variable; else its default. A mesh reads them once, when it starts (``snapshot``),
and hands them to its launcher, host agents and workers (``process_env``: the
variables of the processes it starts). A value of the wrong type, an unknown
``MONARCH_NB_*`` variable (a typo) and ``%config`` of a setting that needs a restart
while meshes run are refused, naming the setting and what it accepts.
"""

from __future__ import annotations

import difflib
import os
import threading

from traitlets import Bool, Enum, Float, Int, TraitError, validate
from traitlets.config import Configurable

from .hooks import Hook

PREFIX = "MONARCH_NB_"
_POSITIVE = ("heartbeat_timeout", "collective_timeout", "stall_seconds", "interrupt_wait")
# variables of that prefix that are not settings: the mesh secret (a worker's key)
NOT_SETTINGS = {
    "MONARCH_NB_KEY": "a worker's mesh secret (hex), when no other source is given",
    "MONARCH_NB_MESH_DIR": "the directory of kept-alive meshes (default: in the Jupyter runtime dir)",
}


class ConfigError(ValueError):
    """A setting's value, or a MONARCH_NB_* variable, that cannot be taken."""


class MonarchNB(Configurable):
    """The settings of monarch_nb (``%config MonarchNB`` lists them)."""

    heartbeat_timeout = Float(
        10.0,
        help="seconds of silence before a worker is unresponsive (and, for joined "
        "workers, the default liveness_timeout)",
    ).tag(config=True, restart=True)
    collective_timeout = Float(
        300.0,
        help="torch.distributed timeout in seconds; also the bound of each operation on "
        "the controller's store",
    ).tag(config=True, restart=True)
    stall_seconds = Float(
        30.0,
        help="a command running longer is a stall: its worker logs where it is and "
        "reports it (status() 'stalled', the dashboard)",
    ).tag(config=True, restart=True)
    interrupt_wait = Float(
        5.0,
        help="seconds interrupted commands get to stop (Ctrl-C in a blocking fetch, wait "
        "or %%monarch cell) before their ranks count as stuck, named in the "
        "KeyboardInterrupt",
    ).tag(config=True)
    progress_delay = Float(0.5, help="seconds before a progress bar appears").tag(config=True)
    timeline_size = Int(
        100_000,
        help="how many command records a mesh's timeline keeps at first "
        "(mesh.timeline_size changes it)",
    ).tag(config=True)
    rendezvous = Enum(
        ("auto", "file", "controller"),
        "auto",
        help="where a mesh's workers meet for torch.distributed: file (a FileStore), "
        "controller (its store through the signed channel), or auto (file on loopback, "
        "controller beyond)",
    ).tag(config=True)
    spawn = Enum(
        ("agent", "popen"),
        "agent",
        help="how local_mesh starts ranks: agent (forked by the host agent) or popen "
        "(a fresh python -m monarch_nb.worker each)",
    ).tag(config=True)
    agent_forkserver_idle = Float(
        600.0,
        help="seconds the fork server of local host agents (it has torch imported, so a "
        "process's first local mesh skips that import) waits for the next mesh after "
        "its last agent ended; 0: no fork server, each process's agent imports torch",
    ).tag(config=True)
    relay_fanout = Bool(
        True,
        help="host agents on other hosts carry their ranks' traffic (False: each rank "
        "connects to the mesh's ROUTER itself)",
    ).tag(config=True)
    sim_slots = Int(
        1024,
        help="the simulated light ranks this process may hold across its "
        "local_mesh(simulate=...) meshes",
    ).tag(config=True)
    sign_full = Bool(
        False,
        help="sign every byte of large buffers (by default: their length and first and "
        "last 64 KiB past 1 MiB)",
    ).tag(config=True, restart=True)
    switch_interval = Float(
        0.001,
        help="seconds: while a mesh runs, this process's sys.setswitchinterval at most (its "
        "IO thread gets the GIL sooner from a loop of remote calls; 0: left as it is)",
    ).tag(config=True, restart=True)
    log = Enum(
        ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"),
        "WARNING",
        help="the level of a worker's own log (the monarch_nb loggers, to its stderr); "
        "user code's logging is not affected",
    ).tag(config=True, restart=True)

    @validate(*_POSITIVE)
    def _positive(self, proposal):
        value = proposal["value"]
        if not value > 0:
            raise TraitError(f"MonarchNB.{proposal['trait'].name} must be > 0, got {value!r}")
        self._no_restart_needed(proposal["trait"].name)
        return value

    @validate(
        "progress_delay",
        "timeline_size",
        "sim_slots",
        "sign_full",
        "switch_interval",
        "log",
        "agent_forkserver_idle",
    )
    def _at_least_zero(self, proposal):
        value = proposal["value"]
        if not isinstance(value, bool) and isinstance(value, (int, float)) and value < 0:
            raise TraitError(f"MonarchNB.{proposal['trait'].name} must be >= 0, got {value!r}")
        self._no_restart_needed(proposal["trait"].name)
        return value

    def _no_restart_needed(self, name: str) -> None:
        if self is not _SETTINGS[0] or not self.trait_metadata(name, "restart"):
            return
        live = LIVE_MESHES.value() if LIVE_MESHES.value is not None else []
        if live:
            raise TraitError(
                f"MonarchNB.{name} needs a restart: the running mesh(es) {', '.join(live)} "
                "read it when they started. Shut them down (%monarch_mesh --shutdown) and "
                "set it again, or pass it to the next mesh as a keyword argument"
            )


LIVE_MESHES = Hook("live_meshes", "() -> the names of the meshes that run (context.py's)")
_SETTINGS: list = [None]
_PROCESS: list = [None]
_lock = threading.RLock()
# a rank forked by a host agent reads its own variables (its Spawn's), not the agent's
os.register_at_fork(after_in_child=lambda: _PROCESS.__setitem__(0, None))


def settings() -> MonarchNB:
    """This process's settings object (``%config MonarchNB`` changes it)."""
    with _lock:
        if _SETTINGS[0] is None:
            obj = MonarchNB()
            obj.set_here = set()  # names set on it (over their variables)
            obj.observe(lambda change: obj.set_here.add(change["name"]))
            _SETTINGS[0] = obj
        return _SETTINGS[0]


def names() -> list[str]:
    return sorted(MonarchNB.class_own_traits(config=True))


def variable(name: str) -> str:
    return PREFIX + name.upper()


def _parse(name: str, text: str):
    trait = MonarchNB.class_traits()[name]
    var = variable(name)
    text = text.strip()
    try:
        if isinstance(trait, Bool):
            if text.lower() not in ("0", "1", "true", "false", ""):
                raise ValueError(text)
            value = text.lower() in ("1", "true")
        elif isinstance(trait, Enum):
            value = text if name != "log" else text.upper()
        else:
            value = trait.from_string(text)
        return MonarchNB(**{name: value}).trait_values()[name]
    except (TraitError, ValueError) as e:
        raise ConfigError(f"{var}={text!r}: {accepts(name)} ({e})") from None


def accepts(name: str) -> str:
    """What setting ``name`` takes, in words."""
    trait = MonarchNB.class_traits()[name]
    if isinstance(trait, Enum):
        return "one of " + ", ".join(map(str, trait.values))
    if isinstance(trait, Bool):
        return "0 or 1"
    if isinstance(trait, Int):
        return "an integer >= 0"
    return "a number > 0" if name in _POSITIVE else "a number >= 0"


def check_environment(environ=None) -> None:
    """Refuse a MONARCH_NB_* variable that names no setting (a typo), naming the close ones."""
    environ = os.environ if environ is None else environ
    known = {variable(n) for n in names()} | set(NOT_SETTINGS)
    for var in sorted(environ):
        if var.startswith(PREFIX) and var not in known:
            close = difflib.get_close_matches(var, sorted(known), n=2)
            hint = f" (did you mean {' or '.join(close)}?)" if close else ""
            raise ConfigError(
                f"{var} is not a monarch_nb setting{hint}; the settings: "
                + ", ".join(sorted(known))
            )


def snapshot(environ=None, **given) -> dict:
    """Every setting's value now: ``given`` (keyword arguments, None: not given), else
    what was set on ``settings()``, else its variable, else its default. Checked."""
    environ = os.environ if environ is None else environ
    check_environment(environ)
    return {name: _resolve(name, environ, given.get(name)) for name in names()}


def _resolve(name: str, environ, given=None):
    """Setting ``name``: ``given``, else set on ``settings()``, else its variable, else
    its default (checked)."""
    if given is not None:
        try:
            return MonarchNB(**{name: given}).trait_values()[name]
        except TraitError as e:
            raise ConfigError(f"{name}={given!r}: {accepts(name)} ({e})") from None
    own = settings()
    if name in own.set_here:
        return getattr(own, name)
    if variable(name) in environ:
        return _parse(name, environ[variable(name)])
    return MonarchNB.class_traits()[name].default_value


def process_settings() -> dict:
    """The settings this process started with (a worker, a host agent: its
    variables, which its controller set), read once."""
    with _lock:
        if _PROCESS[0] is None:
            _PROCESS[0] = snapshot()
        return _PROCESS[0]


def setting(name: str, environ=None):
    """One setting's value now, as ``snapshot`` resolves it; the other variables are
    not read (a mesh checked them at its start: a Ctrl-C must not fail on a typo)."""
    return _resolve(name, os.environ if environ is None else environ)


def process_env(values: dict) -> dict[str, str]:
    """The variables that hand ``values`` to a process this one starts (an agent, a rank)."""
    out = {}
    for name, value in values.items():
        out[variable(name)] = ("1" if value else "0") if isinstance(value, bool) else str(value)
    return out


def markdown_table() -> str:
    """docs/api.md's table of settings, made from the traits (``python -m monarch_nb.config``)."""
    rows = ["| setting | variable | default | accepts | effect |", "| --- | --- | --- | --- | --- |"]
    traits = MonarchNB.class_traits()
    for name in names():
        t = traits[name]
        restart = " (read when a mesh starts)" if t.metadata.get("restart") else ""
        rows.append(
            f"| `{name}` | `{variable(name)}` | `{t.default_value!r}` | {accepts(name)} | "
            f"{t.help}{restart} |"
        )
    for var, what in NOT_SETTINGS.items():
        rows.append(f"| | `{var}` | | | {what} (not a setting) |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(markdown_table())
