"""Where a bench table came from: the checkout's commit, for the table's header."""

from __future__ import annotations

import os
import subprocess


def commit() -> str:
    """This checkout's short commit (``+dirty`` with uncommitted changes to tracked files), or
    "?" outside a git checkout."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"
    return head + ("+dirty" if dirty else "")
