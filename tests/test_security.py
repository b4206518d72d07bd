"""Security of the exporter, through the real CLI where it matters.

One agent process runs with a web config file (TLS from a self-signed CA made
by openssl, basic auth with a bcrypt hash), an admin token, and a kernel cache
whose shared tier is a password-protected Redis holding one tampered entry.
Checked: TLS and basic auth do what the exporter toolkit's file says, probes
stay open, the admin endpoints need the bearer token, a tampered cache entry
never reaches the disk, and no secret shows up in the log, /metrics or
/startupz.  In-process servers cover mutual TLS, a stalled client, the admin
endpoints being off by default, and bad web config files.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
from typing import Any

import bcrypt
import pytest
import redis
import requests

from tests.conftest import ROOT, agent_cmd, run_agent
from tests.helpers.servers import Redis, free_port, wait_until
from tests.helpers.tls import make_ca, make_leaf
from warmup_agent import config, webconfig
from warmup_agent.config import ConfigError

USER, PASSWORD = "prometheus", "scrape-pass-Zq81wXv"
TOKEN = "admin-token-9f3b2c7d1e5a4680"
REDIS_PASSWORD = "redis-pass-44710aa"
KC_SECRET = "kc-secret-5d1e0b7a9c3f2e84"
GOOD = ("inductor", "ab/good.main.cpp", b"// a good kernel\n" * 20)
TAMPERED = ("inductor", "cd/evil.main.so", os.urandom(2048))


def _write(path, text) -> str:
    with open(path, "w") as f:
        f.write(text)
    return str(path)


def _web_config(d, cert, key, users=True, extra_tls="") -> str:
    hashed = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(rounds=4)).decode()
    text = f"tls_server_config:\n  cert_file: {cert}\n  key_file: {key}\n{extra_tls}"
    if users:
        text += f"basic_auth_users:\n  {USER}: '{hashed}'\n"
    return _write(os.path.join(d, "web.yml"), text)


@pytest.fixture(scope="module")
def live(tmp_path_factory, embedded_model, data_dir):
    d = str(tmp_path_factory.mktemp("sec"))
    ca = make_ca(d)
    cert, key = make_leaf(d, ca, "server")
    web = _web_config(d, cert, key)
    rdir = os.path.join(d, "redis")
    os.mkdir(rdir)
    server = Redis(rdir)
    redis.Redis(port=server.port).config_set("requirepass", REDIS_PASSWORD)
    url = f"redis://:{REDIS_PASSWORD}@127.0.0.1:{server.port}/0"
    env = {"WARMUP_AGENT_EXPORTER_WEB_CONFIG_FILE": web,
           "WARMUP_AGENT_EXPORTER_ADMIN_TOKEN_FILE": _write(os.path.join(d, "token"), TOKEN + "\n"),
           "WARMUP_AGENT_KERNEL_CACHE_REDIS_URL": url,
           "WARMUP_AGENT_KERNEL_CACHE_SECRET_FILE": _write(os.path.join(d, "kc.key"), KC_SECRET),
           "WARMUP_AGENT_KERNEL_CACHE_DIR": os.path.join(d, "kc-agent"),
           "WARMUP_AGENT_MODEL_PATH": embedded_model, "WARMUP_AGENT_DATA_DIR": data_dir,
           "WARMUP_AGENT_PREWARM_PROMPT_LENGTHS": "[8]", "WARMUP_AGENT_PREWARM_BATCH_SIZES": "[1]",
           "WARMUP_AGENT_READINESS_WATCH_INTERVAL_SECONDS": "0.5"}

    # A "first pod" with the same configuration publishes two kernels; one is then tampered with.
    from warmup_agent.kernel_cache import KernelCache
    cfg = config.load(env={**env, "WARMUP_AGENT_KERNEL_CACHE_DIR": os.path.join(d, "kc-first")})
    first = KernelCache.from_config(cfg.kernel_cache, data_dir=cfg.data_dir, model=cfg.model, solidify=cfg.solidify)
    for kind, rel, data in (GOOD, TAMPERED):
        path = os.path.join(first.local.dir(kind), rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
    assert first.publish() == 2
    c = redis.Redis(port=server.port, password=REDIS_PASSWORD)
    blob = next(k for k in c.scan_iter(match="*:blob:*") if c.get(k) == TAMPERED[2])
    c.setrange(blob, 100, bytes([TAMPERED[2][100] ^ 0xFF]))

    port = free_port()
    log_path = os.path.join(d, "agent.log")
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("WARMUP_AGENT_")} | env
    proc = subprocess.Popen(agent_cmd("run", "--no-progress", "--listen", f"127.0.0.1:{port}"), cwd=ROOT,
                            env=full_env, stdout=open(log_path, "w"), stderr=subprocess.STDOUT)
    base = f"https://127.0.0.1:{port}"
    ns = type("Live", (), {"base": base, "ca": ca[0], "proc": proc, "log": log_path, "port": port,
                           "agent_kc": os.path.join(d, "kc-agent"), "namespace": first.namespace,
                           "bcrypt_hash": open(web).read().split(f"{USER}: ")[1].strip().strip("'")})
    try:
        wait_until(lambda: proc.poll() is not None or requests.get(base + "/readyz", verify=ns.ca, timeout=2).status_code == 200,
                   180, interval=0.2, what="agent SERVING over https")
        assert proc.poll() is None, open(log_path).read()[-3000:]
        yield ns
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
        server.stop()


def get(live, path, **kw):
    return requests.get(live.base + path, verify=live.ca, timeout=10, **kw)


def post(live, path, token=None, **kw):
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return requests.post(live.base + path, verify=live.ca, timeout=10, headers=headers, **kw)


def test_tls_and_basic_auth_from_the_web_config_file(live):
    r = get(live, "/metrics")
    assert r.status_code == 401 and r.headers["WWW-Authenticate"].startswith("Basic")
    assert get(live, "/metrics", auth=(USER, PASSWORD + "x")).status_code == 401
    assert get(live, "/metrics", auth=("root", PASSWORD)).status_code == 401
    r = get(live, "/metrics", auth=(USER, PASSWORD))
    assert r.status_code == 200 and 'warmup_state{state="SERVING"} 1.0' in r.text
    assert get(live, "/", auth=(USER, PASSWORD)).status_code == 200
    # Probes stay open: the kubelet sends no credentials.
    assert get(live, "/readyz").status_code == 200 and get(live, "/healthz").status_code == 200
    assert get(live, "/startupz").json()["state"] == "SERVING"
    # Plain HTTP on the TLS port gets no answer; a client that does not trust the CA refuses the server.
    with pytest.raises(requests.exceptions.ConnectionError):
        requests.get(f"http://127.0.0.1:{live.port}/readyz", timeout=5)
    with pytest.raises(requests.exceptions.SSLError):
        requests.get(live.base + "/readyz", timeout=5)   # system CAs only


def test_the_start_up_line_names_https_when_tls_comes_from_the_web_config(live):
    text = open(live.log).read()
    assert f"exporter on https://127.0.0.1:{live.port}" in text, text[-3000:]


def test_tampered_kernel_cache_entry_rejected_end_to_end(live):
    text = get(live, "/metrics", auth=(USER, PASSWORD)).text
    assert 'warmup_kernel_cache_requests_total{result="rejected",tier="shared"} 1.0' in text
    assert 'warmup_kernel_cache_requests_total{result="hit",tier="shared"} 1.0' in text
    assert "warmup_kernel_cache_degraded 0.0" in text   # the password-protected Redis was reachable
    local = os.path.join(live.agent_kc, live.namespace)
    with open(os.path.join(local, GOOD[0], GOOD[1]), "rb") as f:
        assert f.read() == GOOD[2]
    assert not os.path.exists(os.path.join(local, TAMPERED[0], TAMPERED[1]))


def test_admin_endpoints_need_the_bearer_token(live):
    for attempt in ({}, {"token": TOKEN[:-1]}, {"auth": (USER, PASSWORD)}):
        r = post(live, "/admin/drain", **attempt)
        assert r.status_code == 401, attempt
    assert get(live, "/admin/drain", auth=(USER, PASSWORD)).status_code == 405
    assert get(live, "/readyz").status_code == 200   # nothing happened

    r = post(live, "/admin/rewarm", token=TOKEN)
    assert r.status_code == 202 and r.json()["state"] == "PRELOAD"
    assert post(live, "/admin/rewarm", token=TOKEN).status_code == 409   # one re-warm at a time
    wait_until(lambda: get(live, "/readyz").status_code == 200, 120, what="SERVING after the re-warm")
    text = get(live, "/metrics", auth=(USER, PASSWORD)).text
    assert 'warmup_state_transitions_total{from="SERVING",to="PRELOAD"} 1.0' in text
    assert 'warmup_state_transitions_total{from="PRIME",to="SERVING"} 2.0' in text

    r = post(live, "/admin/drain", token=TOKEN)
    assert r.status_code == 202 and r.json()["state"] == "DRAINING"
    assert get(live, "/readyz").status_code == 503 and get(live, "/healthz").status_code == 200
    assert post(live, "/admin/drain", token=TOKEN).status_code == 200
    assert post(live, "/admin/rewarm", token=TOKEN).status_code == 409


def test_no_secret_in_log_metrics_or_startupz(live):
    secrets = [PASSWORD, TOKEN, REDIS_PASSWORD, KC_SECRET, live.bcrypt_hash]
    bodies = {"/metrics": get(live, "/metrics", auth=(USER, PASSWORD)).text,
              "/startupz": get(live, "/startupz").text, "/": get(live, "/", auth=(USER, PASSWORD)).text}
    live.proc.send_signal(signal.SIGTERM)
    assert live.proc.wait(60) == 0
    bodies["log"] = open(live.log).read()
    assert "admin: /admin/drain" in bodies["log"]   # the log does record what happened
    for where, text in bodies.items():
        for s in secrets:
            assert s not in text, f"a secret appears in {where}"


# --- in-process servers -----------------------------------------------------------------

class Stub:
    """An agent as far as the server is concerned (exporter.server.ServedAgent).
    Admin calls are refused: these tests only check who may make them."""
    state_name = "SERVING"

    def status(self):
        return {"state": "SERVING"}

    def request_rewarm(self):
        return False

    def request_drain(self):
        return "refused"


def serve(web_config=None, **kw):
    from exporter.metrics import AgentMetrics
    from exporter.server import ExporterServer
    return ExporterServer(Stub(), AgentMetrics().registry, "127.0.0.1", 0, web_config=web_config, **kw).start()


def test_admin_endpoints_are_off_unless_configured():
    s = serve()
    try:
        for method in (requests.post, requests.get):
            assert method(f"http://127.0.0.1:{s.port}/admin/drain", timeout=5,
                          headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 404
        assert requests.get(f"http://127.0.0.1:{s.port}/readyz", timeout=5).status_code == 200
    finally:
        s.stop()


def test_mutual_tls(tmp_path):
    d = str(tmp_path)
    ca = make_ca(d)
    cert, key = make_leaf(d, ca, "server")
    client_ca = make_ca(d, "clients")
    good = make_leaf(d, client_ca, "client", server=False)
    stranger = make_leaf(d, make_ca(d, "other"), "stranger", server=False)
    web = _web_config(d, cert, key, users=False,
                      extra_tls=f"  client_auth_type: RequireAndVerifyClientCert\n  client_ca_file: {client_ca[0]}\n")
    s = serve(webconfig.load(web))
    url = f"https://127.0.0.1:{s.port}/metrics"
    try:
        assert requests.get(url, verify=ca[0], cert=good, timeout=5).status_code == 200
        for client_cert in (None, stranger):
            with pytest.raises((requests.exceptions.SSLError, requests.exceptions.ConnectionError)):
                requests.get(url, verify=ca[0], cert=client_cert, timeout=5)
    finally:
        s.stop()


def test_a_stalled_tls_client_does_not_block_others(tmp_path):
    d = str(tmp_path)
    ca = make_ca(d)
    s = serve(webconfig.load(_web_config(d, *make_leaf(d, ca, "server"), users=False)))
    try:
        with socket.create_connection(("127.0.0.1", s.port)) as idle:   # connects, never says hello
            idle.sendall(b"\x16")
            assert requests.get(f"https://127.0.0.1:{s.port}/readyz", verify=ca[0], timeout=5).status_code == 200
    finally:
        s.stop()


BAD_WEB = [
    ("tls_server_config:\n  cert_fil: a\n", "unknown key 'cert_fil'; did you mean 'cert_file'?"),
    ("basic_auth_user:\n  a: b\n", "unknown key 'basic_auth_user'; did you mean 'basic_auth_users'?"),
    ("basic_auth_users:\n  alice: plaintext-password\n", "key 'basic_auth_users.alice': expected a bcrypt hash"),
    ("tls_server_config:\n  cert_file: server.crt\n", "TLS needs both cert_file and key_file"),
    ("tls_server_config:\n  cert_file: nope.crt\n  key_file: server.key\n", "key 'tls_server_config.cert_file'"),
    ("tls_server_config:\n  cert_file: server.crt\n  key_file: server.key\n  client_auth_type: RequireAnyClientCert\n",
     "expected one of NoClientCert, VerifyClientCertIfGiven, RequireAndVerifyClientCert"),
    ("tls_server_config:\n  cert_file: server.crt\n  key_file: server.key\n  client_auth_type: RequireAndVerifyClientCert\n",
     "needs a CA file"),
    ("tls_server_config:\n  cert_file: server.key\n  key_file: server.key\n", "cannot load the certificate"),
    ("tls_server_config: [1, 2\n", "YAML syntax error at line"),
]


@pytest.mark.parametrize("text,expected", BAD_WEB, ids=[b[1][:40] for b in BAD_WEB])
def test_bad_web_config_is_one_line(tmp_path, text, expected):
    d = str(tmp_path)
    make_leaf(d, make_ca(d), "server")    # server.crt / server.key next to the file: relative paths
    path = _write(os.path.join(d, "web.yml"), text)
    with pytest.raises(ConfigError) as e:
        webconfig.load(path)
    assert "\n" not in str(e.value) and expected in str(e.value) and path in str(e.value), str(e.value)
    assert "plaintext-password" not in str(e.value)


@pytest.mark.slow  # an agent process
def test_cli_bad_web_config_and_short_token_exit_2(tmp_path, data_dir):
    web = _write(tmp_path / "web.yml", "basic_auth_users:\n  alice: plaintext-password\n")
    short = _write(tmp_path / "token", "short")
    for env, key in (({"WARMUP_AGENT_EXPORTER_WEB_CONFIG_FILE": web}, "basic_auth_users.alice"),
                     ({"WARMUP_AGENT_EXPORTER_ADMIN_TOKEN_FILE": short}, "exporter.admin_token_file")):
        r = run_agent("run", "--once", "--no-progress", "--data-dir", data_dir, "--listen", "127.0.0.1:0",
                      env=env, timeout=120)
        lines = [l for l in r.stderr.splitlines() if l.strip() and " INFO " not in l]
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
        assert len(lines) == 1 and key in lines[0], r.stderr[-2000:]
        assert "plaintext-password" not in r.stderr and "short" not in lines[0].split(":")[-1]


def test_web_config_and_older_keys_together_are_refused(tmp_path):
    d = str(tmp_path)
    cert, key = make_leaf(d, make_ca(d), "server")
    cfg = config.load(env={"WARMUP_AGENT_EXPORTER_WEB_CONFIG_FILE": _web_config(d, cert, key),
                           "WARMUP_AGENT_EXPORTER_TLS_CERT_FILE": cert, "WARMUP_AGENT_EXPORTER_TLS_KEY_FILE": key})
    from warmup_agent import webconfig
    with pytest.raises(ConfigError, match="exporter.web_config_file': set it or the exporter.tls_"):
        webconfig.resolve(cfg.exporter)       # the one place the exporter's protection is resolved


def test_bcrypt_check_is_cached_but_never_wrong():
    hashed = bcrypt.hashpw(b"pw-1", bcrypt.gensalt(rounds=4))
    auth = webconfig.BasicAuth({"u": hashed})
    import base64
    h = lambda u, p: "Basic " + base64.b64encode(f"{u}:{p}".encode()).decode()  # noqa: E731
    assert auth.check(h("u", "pw-1")) and auth.check(h("u", "pw-1"))   # second from the cache
    assert not auth.check(h("u", "pw-2")) and not auth.check(h("v", "pw-1"))
    assert not auth.check("Basic !!!") and not auth.check(None) and not auth.check("Bearer x")
    assert all(b"pw-1" not in t for t in auth._ok)


# --- non-ASCII basic auth (issue 73) ------------------------------------------------------

NON_ASCII_USER, NON_ASCII_PASSWORD = "prométhée", "пароль-Zq81 ü€"


def _basic(user: str, password: str) -> dict:
    """The header as curl and browsers send it: the UTF-8 bytes, base64-encoded."""
    import base64
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode("utf-8")).decode()}


def _protected(tmp_path, how: str) -> tuple[Any, str, str | bool]:
    """The agent's HTTP server (exporter.server.ExporterServer, as `warmup-agent run`
    builds it: config.load + webconfig.resolve) guarding /metrics with a non-ASCII
    user and password; returns (the server, its base URL, requests' verify)."""
    d = str(tmp_path)
    if how == "web config":      # TLS and a bcrypt hash from the web config file
        ca = make_ca(d)
        cert, key = make_leaf(d, ca, "server")
        hashed = bcrypt.hashpw(NON_ASCII_PASSWORD.encode("utf-8"), bcrypt.gensalt(rounds=4)).decode()
        web = _write(os.path.join(d, "web.yml"), f"tls_server_config:\n  cert_file: {cert}\n  key_file: {key}\n"
                                                 f"basic_auth_users:\n  {NON_ASCII_USER}: '{hashed}'\n")
        env, verify = {"WARMUP_AGENT_EXPORTER_WEB_CONFIG_FILE": web}, ca[0]
    else:                        # the older keys: a user name and a plain password file
        with open(os.path.join(d, "password"), "w", encoding="utf-8") as f:
            f.write(NON_ASCII_PASSWORD + "\n")
        env = {"WARMUP_AGENT_EXPORTER_BASIC_AUTH_USERNAME": NON_ASCII_USER,
               "WARMUP_AGENT_EXPORTER_BASIC_AUTH_PASSWORD_FILE": os.path.join(d, "password")}
        verify = True
    from exporter.metrics import AgentMetrics
    from exporter.server import ExporterServer
    security = webconfig.resolve(config.load(env=env).exporter)
    s = ExporterServer(Stub(), AgentMetrics().registry, "127.0.0.1", 0, security=security).start()
    return s, ("https" if security.tls else "http") + f"://127.0.0.1:{s.port}", verify


@pytest.mark.parametrize("how", ["web config", "older keys"])
def test_a_non_ascii_password_logs_in_and_a_wrong_one_gets_401(tmp_path, how):
    s, base, verify = _protected(tmp_path, how)
    try:
        get = lambda **kw: requests.get(base + "/metrics", verify=verify, timeout=10, **kw)  # noqa: E731
        r = get(headers=_basic(NON_ASCII_USER, NON_ASCII_PASSWORD))
        assert r.status_code == 200 and "warmup_" in r.text
        # wrong, all answered 401 (a dropped connection raises ConnectionError here)
        for user, password in ((NON_ASCII_USER, NON_ASCII_PASSWORD + "x"), (NON_ASCII_USER, "пароль"),
                               ("prometheus", NON_ASCII_PASSWORD), (NON_ASCII_USER, NON_ASCII_PASSWORD[:-1]),
                               (NON_ASCII_USER, "ascii-only")):
            r = get(headers=_basic(user, password))
            assert r.status_code == 401 and r.headers["WWW-Authenticate"].startswith("Basic"), (user, password)
        assert get(headers={"Authorization": "Basic !!!"}).status_code == 401
        assert get(headers={"Authorization": "Basic " + "bm8tY29sb24="}).status_code == 401   # "no-colon"
    finally:
        s.stop()


@pytest.mark.parametrize("how, scheme", [("web config", "https"), ("older keys", "http"), ("none", "http")])
def test_the_start_up_line_names_the_scheme_served(tmp_path, caplog, how, scheme):
    """`warmup-agent run`'s start-up line (cli._serve_endpoints), in process: https where
    TLS comes from the web config file, not only from exporter.tls_cert_file."""
    import logging

    from exporter.metrics import AgentMetrics
    from warmup_agent import cli
    d = str(tmp_path)
    env: dict[str, str] = {"WARMUP_AGENT_EXPORTER_LISTEN": "127.0.0.1:0"}
    if how == "web config":
        env["WARMUP_AGENT_EXPORTER_WEB_CONFIG_FILE"] = _web_config(d, *make_leaf(d, make_ca(d), "server"))
    elif how == "older keys":
        env["WARMUP_AGENT_EXPORTER_BASIC_AUTH_USERNAME"] = USER
        env["WARMUP_AGENT_EXPORTER_BASIC_AUTH_PASSWORD_FILE"] = _write(os.path.join(d, "pw"), PASSWORD)
    agent = Stub()
    agent.metrics = AgentMetrics()    # type: ignore[attr-defined]
    with caplog.at_level(logging.INFO, logger="warmup_agent"):
        server, proxy = cli._serve_endpoints(config.load(env=env), agent, None, "/models/m")
    try:
        assert proxy is None and server.tls == (scheme == "https")
        lines = [r.getMessage() for r in caplog.records if "exporter on " in r.getMessage()]
        assert len(lines) == 1 and lines[0].endswith(f"exporter on {scheme}://127.0.0.1:{server.port}"), lines
    finally:
        server.stop()
