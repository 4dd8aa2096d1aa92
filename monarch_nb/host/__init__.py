"""The host agent (``monarch-nb-host``): one process per host that imports torch
once and forks the host's ranks on demand (see docs/hosts.md)."""
