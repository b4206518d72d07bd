"""The exporter's web config file, in the style of the Prometheus exporter toolkit.

    tls_server_config:
      cert_file: server.crt            # relative paths: relative to this file
      key_file: server.key
      client_auth_type: RequireAndVerifyClientCert   # or VerifyClientCertIfGiven, NoClientCert
      client_ca_file: clients-ca.crt
      min_version: TLS12               # TLS10 .. TLS13
    basic_auth_users:
      prometheus: $2b$12$...           # bcrypt hash (htpasswd -nBC 12 prometheus)

The same file as node_exporter's `--web.config.file`.  Every problem is a one-line
`ConfigError`.  `resolve` works out the exporter's protection from the `exporter.*`
keys; the server receives the resulting `ServerSecurity` and never sees the config.
"""
from __future__ import annotations

import base64
import difflib
import hashlib
import hmac
import os
import ssl
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import yaml

from warmup_agent.config import ConfigError

if TYPE_CHECKING:  # types only
    from warmup_agent.config_sections import ExporterSection

# RequestClientCert and RequireAnyClientCert have no ssl-module equivalent: refused.
CLIENT_AUTH = {
    "NoClientCert": ssl.CERT_NONE,
    "VerifyClientCertIfGiven": ssl.CERT_OPTIONAL,
    "RequireAndVerifyClientCert": ssl.CERT_REQUIRED,
}
TLS_VERSIONS = {"TLS10": ssl.TLSVersion.TLSv1, "TLS11": ssl.TLSVersion.TLSv1_1,
                "TLS12": ssl.TLSVersion.TLSv1_2, "TLS13": ssl.TLSVersion.TLSv1_3}
_TOP = ("tls_server_config", "basic_auth_users", "http_server_config")
_TLS = ("cert_file", "key_file", "client_auth_type", "client_ca_file", "min_version")


@dataclass
class TLSConfig:
    cert_file: str
    key_file: str
    client_auth_type: str = "NoClientCert"
    client_ca_file: str | None = None
    min_version: str = "TLS12"

    def context(self) -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = TLS_VERSIONS[self.min_version]
        ctx.load_cert_chain(self.cert_file, self.key_file)
        ctx.verify_mode = CLIENT_AUTH[self.client_auth_type]
        if self.client_ca_file:
            ctx.load_verify_locations(self.client_ca_file)
        return ctx


@dataclass
class WebConfig:
    tls: TLSConfig | None = None
    users: dict[str, bytes] = field(default_factory=dict)   # user -> bcrypt hash


def _unknown(where: str, name: str, known: tuple[str, ...]) -> ConfigError:
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.5)
    hint = f"; did you mean '{close[0]}'?" if close else "; expected one of " + ", ".join(known)
    return ConfigError(f"{where}: unknown key '{name}'{hint}", "exporter.web_config_file")


def load(path: str) -> WebConfig:
    """Parse and check the web config file, down to loading the certificate."""
    key = "exporter.web_config_file"

    def err(msg: str) -> ConfigError:
        return ConfigError(f"{path}: {msg}", key)

    try:
        with open(path, encoding="utf-8") as f:
            tree = yaml.safe_load(f.read())
    except OSError as e:
        raise ConfigError(f"key '{key}': cannot read {path}: {e.strerror}", key) from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise err(f"YAML syntax error{where}: {getattr(e, 'problem', None) or 'invalid YAML'}") from None
    tree = tree or {}
    if not isinstance(tree, dict):
        raise err(f"expected a mapping with {', '.join(_TOP)}")
    for name in tree:
        if name not in _TOP:
            raise _unknown(path, str(name), _TOP)
    base = os.path.dirname(os.path.abspath(path))

    def file_at(section: str, name: str, value: Any) -> str:
        if not isinstance(value, str) or not value:
            raise err(f"key '{section}.{name}': expected a file path")
        full = value if os.path.isabs(value) else os.path.join(base, value)
        if not os.path.isfile(full):
            raise err(f"key '{section}.{name}': {full} is not a readable file")
        return full

    wc = WebConfig()
    tls = tree.get("tls_server_config")
    if tls is not None:
        if not isinstance(tls, dict):
            raise err("key 'tls_server_config': expected a mapping")
        for name in tls:
            if name not in _TLS:
                raise _unknown(f"{path}: tls_server_config", str(name), _TLS)
        if not tls.get("cert_file") or not tls.get("key_file"):
            raise err("key 'tls_server_config': TLS needs both cert_file and key_file")
        auth = tls.get("client_auth_type", "NoClientCert")
        if auth not in CLIENT_AUTH:
            raise err(f"key 'tls_server_config.client_auth_type': got {auth!r}; expected one of {', '.join(CLIENT_AUTH)}")
        version = tls.get("min_version", "TLS12")
        if version not in TLS_VERSIONS:
            raise err(f"key 'tls_server_config.min_version': got {version!r}; expected one of {', '.join(TLS_VERSIONS)}")
        ca = tls.get("client_ca_file")
        if auth != "NoClientCert" and not ca:
            raise err(f"key 'tls_server_config.client_ca_file': client_auth_type {auth} needs a CA file to verify clients")
        wc.tls = TLSConfig(file_at("tls_server_config", "cert_file", tls["cert_file"]),
                           file_at("tls_server_config", "key_file", tls["key_file"]), auth,
                           file_at("tls_server_config", "client_ca_file", ca) if ca else None, version)
        try:
            wc.tls.context()
        except (ssl.SSLError, OSError) as e:
            raise err(f"key 'tls_server_config': cannot load the certificate, key or CA: {e}") from None

    users = tree.get("basic_auth_users")
    if users is not None:
        if not isinstance(users, dict) or not users:
            raise err("key 'basic_auth_users': expected a mapping of user: bcrypt hash")
        for user, hashed in users.items():
            # Never echo the hash back: it is not the password, but it is guessable offline.
            if not isinstance(hashed, str) or not hashed.startswith(("$2a$", "$2b$", "$2y$")) or len(hashed) != 60:
                raise err(f"key 'basic_auth_users.{user}': expected a bcrypt hash ($2a$/$2b$/$2y$, 60 characters)")
            wc.users[str(user)] = hashed.encode()
    return wc


class BasicAuth:
    """Checks `Authorization: Basic ...` against bcrypt hashes.  bcrypt is slow on
    purpose, so successful checks are cached by a keyed digest, never the password."""

    def __init__(self, users: dict[str, bytes]):
        self.users = users
        self._key = os.urandom(32)
        self._ok: set[bytes] = set()
        self._lock = threading.Lock()

    def check(self, header: str | None) -> bool:
        if not header or not header.startswith("Basic "):
            return False
        try:
            user, sep, password = base64.b64decode(header[6:], validate=True).decode("utf-8").partition(":")
        except (ValueError, UnicodeDecodeError):
            return False
        hashed = self.users.get(user)
        if not sep or hashed is None:
            return False
        token = hmac.new(self._key, f"{user}\0{password}".encode() + hashed, hashlib.sha256).digest()
        with self._lock:
            if token in self._ok:
                return True
        import bcrypt
        try:
            ok = bcrypt.checkpw(password.encode("utf-8"), hashed)
        except ValueError:
            return False
        if ok:
            with self._lock:
                if len(self._ok) > 1024:   # bound memory: a flood of distinct good passwords is unlikely
                    self._ok.clear()
                self._ok.add(token)
        return ok


def read_token(path: str, key: str) -> str:
    """A bearer token from a file (>= 16 characters: it guards state changes)."""
    try:
        with open(path, encoding="utf-8") as f:
            token = f.read().strip()
    except OSError as e:
        raise ConfigError(f"key '{key}': cannot read {path}: {e.strerror}", key) from None
    if len(token) < 16:
        raise ConfigError(f"key '{key}': {path} holds {len(token)} characters; expected a token of at least 16", key)
    return token


class PasswordAuth:
    """The older single-user basic auth (exporter.basic_auth_username + password file).
    Compared as UTF-8 bytes: hmac.compare_digest refuses str with non-ASCII characters."""

    def __init__(self, user: str, password: str):
        self.user, self.password = user.encode("utf-8"), password.encode("utf-8")

    def check(self, header: str | None) -> bool:
        if not header or not header.startswith("Basic "):
            return False
        try:
            user, sep, password = base64.b64decode(header[6:], validate=True).partition(b":")
        except ValueError:   # not base64 (binascii.Error)
            return False
        return bool(sep) & hmac.compare_digest(user, self.user) & hmac.compare_digest(password, self.password)


class Authenticator(Protocol):
    def check(self, header: str | None) -> bool: ...


@dataclass(frozen=True)
class ServerSecurity:
    """The exporter's protection; None for plain HTTP, no auth, no admin endpoints."""
    tls: ssl.SSLContext | None = None
    auth: Authenticator | None = None
    admin_token: str | None = None

    @classmethod
    def of(cls, web_config: WebConfig | None = None, tls_cert: str | None = None, tls_key: str | None = None,
           basic_auth: tuple[str, str] | None = None, admin_token: str | None = None) -> ServerSecurity:
        """From a web config and/or the older keys, which win where both are given."""
        ctx: ssl.SSLContext | None = None
        auth: Authenticator | None = None
        if web_config is not None:
            ctx = web_config.tls.context() if web_config.tls else None
            auth = BasicAuth(web_config.users) if web_config.users else None
        if tls_cert:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.minimum_version = ssl.TLSVersion.TLSv1_2
            ctx.load_cert_chain(tls_cert, tls_key)
        if basic_auth:
            auth = PasswordAuth(*basic_auth)
        return cls(ctx, auth, admin_token)


def read_secret(path: str, key: str) -> str:
    """A secret from a file, stripped; ConfigError (one line) when it cannot be read."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().strip()
    except OSError as e:
        raise ConfigError(f"key '{key}': cannot read {path}: {e.strerror}", key) from None


def resolve(ec: ExporterSection) -> ServerSecurity:
    """The exporter's protection from the `exporter.*` keys, reading every file named."""
    basic_auth = None
    if ec.basic_auth_username and ec.basic_auth_password_file:   # config.load wants both or neither
        basic_auth = (ec.basic_auth_username, read_secret(ec.basic_auth_password_file, "exporter.basic_auth_password_file"))
    web_config = None
    if ec.web_config_file:
        if ec.tls_cert_file or basic_auth:
            raise ConfigError("key 'exporter.web_config_file': set it or the exporter.tls_*/basic_auth_* keys, "
                              "not both", "exporter.web_config_file")
        web_config = load(ec.web_config_file)
    token = read_token(ec.admin_token_file, "exporter.admin_token_file") if ec.admin_token_file else None
    return ServerSecurity.of(web_config, ec.tls_cert_file, ec.tls_key_file, basic_auth, token)
