"""The wheel carries the appliance's run-time folders (appliance/assets.py, ADR 0017).

Everything else about the package is in pyproject.toml; this only adds a build step.
"""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

# appliance.assets.FOLDERS (not imported: the package's dependencies are not there at build time).
FOLDERS = ("docker", "grafana", "prometheus", "deploy/observability")
IGNORED = shutil.ignore_patterns("__pycache__", "*.pyc", "tests")


class BuildWithAssets(build_py):
    """Copy the repository's run-time folders into ``appliance/_assets`` of the build."""

    def run(self):
        super().run()
        here = Path(__file__).resolve().parent
        target = Path(self.build_lib) / "appliance" / "_assets"
        shutil.rmtree(target, ignore_errors=True)
        for folder in FOLDERS:
            shutil.copytree(here / folder, target / folder, ignore=IGNORED)


setup(cmdclass={"build_py": BuildWithAssets})
