"""Build hook: compile the NCCL tuner plugin (C) with the system compiler at install time.

Everything else is declared in pyproject.toml. A failed build is not fatal: the
library is then built on first use (``concerto_jax.autoccl.plugin.ensure_built``).
"""

import os
import shutil
import subprocess

from setuptools import setup
from setuptools.command.build_py import build_py

_PLUGIN_DIR = os.path.join("concerto_jax", "autoccl", "nccl_tuner")
_LIBRARY = "libnccl-tuner-concerto.so"


class BuildPyWithPlugin(build_py):
    """``build_py`` that also compiles ``nccl_tuner/concerto_tuner.c`` into the package."""

    def run(self):
        super().run()
        out_dirs = [_PLUGIN_DIR] if getattr(self, "editable_mode", False) else [
            os.path.join(self.build_lib, _PLUGIN_DIR)]
        cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
        for out_dir in out_dirs:
            if cc is None:
                self.warn("no C compiler found: the NCCL tuner plugin will be built on first use")
                return
            os.makedirs(out_dir, exist_ok=True)
            cmd = [cc, "-shared", "-fPIC", "-O2", "-Wall", "-I", _PLUGIN_DIR, "-o",
                   os.path.join(out_dir, _LIBRARY), os.path.join(_PLUGIN_DIR, "concerto_tuner.c")]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                self.warn(f"NCCL tuner plugin not built at install ({proc.stderr.strip()[:300]}); "
                          "it will be built on first use")


setup(cmdclass={"build_py": BuildPyWithPlugin})
