"""An editable install on a machine without Node.js works: the JupyterLab extension is
skipped with a one-line note, no traceback.

A copy of this tree (its tracked and unignored files: no extension built before) is
installed editable (``pip install --no-deps -v -e``, build isolation as a user gets it)
into a fresh venv, with a PATH on which every program is reachable but node.
"""

import os
import shutil
import subprocess
import sys
import tempfile
import venv

NODE = {"node", "nodejs", "npm", "npx", "corepack", "yarn", "yarnpkg", "jlpm"}
NOTE = "monarch_nb: Node.js not found: skipped the JupyterLab extension"

root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
with tempfile.TemporaryDirectory(prefix="mnb-nonode-") as tmp:
    src = os.path.join(tmp, "src")
    files = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=root,
        check=True,
        capture_output=True,
    ).stdout.decode()
    for rel in filter(None, files.split("\0")):
        if os.path.isfile(os.path.join(root, rel)):
            os.makedirs(os.path.dirname(os.path.join(src, rel)), exist_ok=True)
            shutil.copy2(os.path.join(root, rel), os.path.join(src, rel))

    bare = os.path.join(tmp, "bin")  # every program on PATH, but no node
    os.makedirs(bare)
    for d in os.environ["PATH"].split(os.pathsep):
        if not os.path.isdir(d) or os.path.realpath(d).startswith(os.path.realpath(sys.prefix)):
            continue  # the current venv stays out: the new one comes first
        for name in os.listdir(d):
            link = os.path.join(bare, name)
            if name not in NODE and not os.path.lexists(link):
                os.symlink(os.path.join(d, name), link)
    env_dir = os.path.join(tmp, "venv")
    venv.create(env_dir, with_pip=True)
    py = os.path.join(env_dir, "bin", "python")
    env = dict(os.environ, PATH=os.pathsep.join([os.path.join(env_dir, "bin"), bare]))
    env.pop("VIRTUAL_ENV", None)
    env.pop("PYTHONPATH", None)
    assert shutil.which("node", path=env["PATH"]) is None, "node is still on the PATH"

    proc = subprocess.run(
        [py, "-m", "pip", "install", "--no-deps", "-v", "-e", src],
        cwd=src,
        env=env,
        capture_output=True,
        text=True,
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"editable install without node failed:\n{log[-6000:]}"
    notes = [ln.strip() for ln in log.splitlines() if ln.strip().startswith("monarch_nb:")]
    assert notes and all(n.startswith(NOTE) for n in notes), f"no one-line note: {notes}"
    assert "Traceback" not in log, log[-6000:]
    found = subprocess.run(
        [py, "-c", "import importlib.util as u; print(u.find_spec('monarch_nb').origin)"],
        cwd=tmp,
        env=env,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    assert found == os.path.join(src, "monarch_nb", "__init__.py"), found
    print(f"editable install without node: ok ({notes[0]})")
