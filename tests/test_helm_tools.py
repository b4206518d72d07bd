"""tools/fetch_helm.py and tools/sync_chart_files.py as CI calls them."""
from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers.paths import ROOT_PATH as ROOT

HELM = ROOT / ".tools" / "helm"


def run(*args):
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


@pytest.mark.slow  # helm
def test_fetch_helm_is_idempotent_and_pins_the_version():
    if not HELM.is_file():
        pytest.fail(f"{HELM} is missing: run `.venv/bin/python tools/fetch_helm.py` first", pytrace=False)
    out = run("tools/fetch_helm.py")
    assert out.returncode == 0, out.stderr
    assert "is already Helm v3.17.3" in out.stdout   # no second download
    version = subprocess.run([str(HELM), "version", "--template", "{{.Version}}"], capture_output=True, text=True,
                             env={"HOME": str(ROOT / ".tools")}).stdout
    assert version == "v3.17.3"


def test_sync_check_passes_on_the_committed_chart():
    out = run("tools/sync_chart_files.py", "--check")
    assert out.returncode == 0, out.stderr
    assert "match alerts/, dashboards/ and the server kinds" in out.stdout
