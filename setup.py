"""Maps the namespace package ``kiln`` onto its source folders: the product's (common/,
runtime/, kernels/, operator/, which the images copy) and the development control plane's
(devcluster/, absent from the images, so their wheels leave it out); everything else lives in
pyproject.toml."""

from pathlib import Path

from setuptools import find_namespace_packages, setup

_ROOTS = ("common", "runtime", "kernels", "operator", "devcluster")
packages: list[str] = []
package_dir: dict[str, str] = {}
for root in _ROOTS:
    for pkg in find_namespace_packages(where=root, include=["kiln.*"]):
        if not (Path(root) / pkg.replace(".", "/")).is_dir():
            continue
        packages.append(pkg)
        package_dir[pkg] = f"{root}/{pkg.replace('.', '/')}"

setup(packages=packages, package_dir=package_dir)
