"""How a mesh's workers start: fresh processes, a host agent's forks, simulated
hosts, agents on other hosts, Slurm. The API picks one; the controller drives it
through ``controller.workers.Launcher``."""

from .host_agent import HostLauncher, default_launcher
from .local import ExternalLauncher, LocalLauncher

__all__ = ["ExternalLauncher", "HostLauncher", "LocalLauncher", "default_launcher"]
