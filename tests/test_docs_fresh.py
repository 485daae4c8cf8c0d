"""docs/config-reference.md is generated from the typed configs; it must match the code."""
from __future__ import annotations

import subprocess
import sys

from testutil import REPO


def test_config_reference_is_current():
    res = subprocess.run([sys.executable, "-m", "tools.gen_config_docs", "--check"], cwd=REPO,
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
