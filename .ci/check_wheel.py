"""The wheel in DIR carries the built JupyterLab extension where JupyterLab finds it."""

import glob
import sys
import zipfile

wheels = glob.glob(f"{sys.argv[1]}/monarch_nb-*.whl")
assert len(wheels) == 1, f"expected one monarch_nb wheel in {sys.argv[1]}, found {wheels}"
names = zipfile.ZipFile(wheels[0]).namelist()
ext = next(
    (
        n.rsplit("package.json", 1)[0]
        for n in names
        if n.endswith("/data/share/jupyter/labextensions/monarch-nb/package.json")
    ),
    None,
)
assert ext, f"{wheels[0]}: no share/jupyter/labextensions/monarch-nb/package.json"
missing = [f for f in ("install.json", "static/style.js") if ext + f not in names]
assert not missing, f"{wheels[0]}: the extension lacks {missing}"
assert any(n.startswith(ext + "static/remoteEntry.") for n in names), "no remoteEntry.*.js"
print(f"{wheels[0]}: the built JupyterLab extension is inside ({ext})")
