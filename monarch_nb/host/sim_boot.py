"""Starts a simulated host without torch: ``python .../monarch_nb/host/sim_boot.py
--simulate N ...`` (what the controller's HostAgent runs for ``simulate=N``).

``import monarch_nb`` loads the API, and with it torch (the tensor engine). A
simulated host needs only ``monarch_nb.protocol`` and ``monarch_nb.host``, so
this file, run as a script, registers the package without running its
``__init__`` and then calls ``monarch-nb-host``'s main.
"""

from __future__ import annotations

import os
import sys
import types


def _bare_package() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(here)
    if sys.path and os.path.abspath(sys.path[0] or ".") == here:
        sys.path[0] = os.path.dirname(root)  # the package's parent, not this folder
    pkg = types.ModuleType("monarch_nb", "monarch_nb, its __init__ skipped (a simulated host)")
    pkg.__path__ = [root]
    pkg.__file__ = os.path.join(root, "__init__.py")
    sys.modules.setdefault("monarch_nb", pkg)


if __name__ == "__main__":
    _bare_package()
    from monarch_nb.host.__main__ import main

    main()
