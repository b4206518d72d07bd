"""Self-signed certificates for the tests, made with the openssl command line
(installed with Debian's openssl package; no Python dependency)."""
from __future__ import annotations

import os
import subprocess


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def make_ca(d, name: str = "ca") -> tuple[str, str]:
    """A self-signed CA: (cert, key)."""
    cert, key = os.path.join(d, f"{name}.crt"), os.path.join(d, f"{name}.key")
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", key, "-out", cert, "-days", "2", "-subj", f"/CN=warmup-agent test {name}",
             "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign")
    return cert, key


def make_leaf(d, ca: tuple[str, str], name: str, server: bool = True) -> tuple[str, str]:
    """A certificate signed by `ca`: a server cert for 127.0.0.1/localhost, or a client cert."""
    cert, key, csr = (os.path.join(d, f"{name}.{ext}") for ext in ("crt", "key", "csr"))
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", key, "-out", csr, "-subj", f"/CN={name}")
    ext = os.path.join(d, f"{name}.ext")
    with open(ext, "w") as f:
        f.write("subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n" if server
                else "extendedKeyUsage=clientAuth\n")
    _openssl("x509", "-req", "-in", csr, "-CA", ca[0], "-CAkey", ca[1], "-CAcreateserial",
             "-out", cert, "-days", "2", "-extfile", ext)
    return cert, key
