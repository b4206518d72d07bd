"""Config: defaults, file, environment and flags; every bad value is one clear line."""
import pytest

from tests.conftest import run_agent
from warmup_agent import config
from warmup_agent.config import ConfigError


def write(tmp_path, text: str) -> str:
    p = tmp_path / "agent.yaml"
    p.write_text(text)
    return str(p)


def test_defaults_match_the_seed(clean_env):
    cfg = config.load(env={})
    assert cfg.readiness.p50_threshold_seconds == 0.85
    assert cfg.readiness.p90_threshold_seconds == 2.1
    assert cfg.deadlines.preload_seconds == 30.0
    assert cfg["exporter.listen"] == "127.0.0.1:9400"
    assert cfg["engine"] == "torch"


def test_precedence_file_then_env_then_flags(tmp_path):
    path = write(tmp_path, "readiness:\n  min_probes: 5\n  window_size: 50\nprewarm:\n  prompt_lengths: [8, 16]\n")
    cfg = config.load(path, env={"WARMUP_AGENT_READINESS_MIN_PROBES": "7", "WARMUP_AGENT_PREWARM_BATCH_SIZES": "[1, 8]"},
                      flags={"exporter.listen": "0.0.0.0:9500"})
    assert cfg["readiness.min_probes"] == 7 and cfg.sources["readiness.min_probes"] == "env"
    assert cfg["readiness.window_size"] == 50 and cfg.sources["readiness.window_size"] == "file"
    assert cfg["prewarm.prompt_lengths"] == [8, 16]
    assert cfg["prewarm.batch_sizes"] == [1, 8]
    assert cfg["exporter.listen"] == "0.0.0.0:9500" and cfg.sources["exporter.listen"] == "flag"


BAD = [
    ("readiness:\n  p50_threshold_seconds: -1\n", "readiness.p50_threshold_seconds", "-1", "a number > 0"),
    ("readiness:\n  p50_threshold_seconds: 3.0\n", "readiness.p50_threshold_seconds", "3.0", "at most readiness.p90_threshold_seconds"),
    ("readiness:\n  min_probes: ten\n", "readiness.min_probes", "'ten'", "an integer > 0"),
    ("exporter:\n  listen: 127.0.0.1:70000\n", "exporter.listen", "70000", "port in 0..65535"),
    ("engine: tensorrt\n", "engine", "'tensorrt'", "one of torch, vllm, openai"),
    ("prewarm:\n  prompt_lengths: [16, -4]\n", "prewarm.prompt_lengths", "-4", "integers > 0"),
    ("prewarm:\n  batch_sizes: []\n", "prewarm.batch_sizes", "[]", "non-empty list"),
    ("reserve:\n  pin_cpus: maybe\n", "reserve.pin_cpus", "'maybe'", "true or false"),
    ("readiness:\n  min_probes: 500\n", "readiness.min_probes", "500", "at most readiness.window_size"),
]


@pytest.mark.parametrize("text,key,value,expected", BAD, ids=[b[1] + "=" + b[2] for b in BAD])
def test_bad_value_names_file_key_value_and_expectation(tmp_path, text, key, value, expected):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        config.load(path, env={})
    msg = str(e.value)
    assert "\n" not in msg
    assert path in msg and f"'{key}'" in msg and value in msg and expected in msg, msg


def test_unknown_key_names_the_closest_known_key(tmp_path):
    path = write(tmp_path, "readiness:\n  p50_treshold_seconds: 0.5\n")
    with pytest.raises(ConfigError, match=r"unknown key 'readiness.p50_treshold_seconds'; did you mean 'readiness.p50_threshold_seconds'\?"):
        config.load(path, env={})


def test_unknown_section_and_env_variable(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown key 'readyness'; did you mean 'readiness'\?$"):
        config.load(write(tmp_path, "readyness:\n  min_probes: 3\n"), env={})
    with pytest.raises(ConfigError, match="WARMUP_AGENT_READINESS_MIN_PROBE.*did you mean WARMUP_AGENT_READINESS_MIN_PROBES"):
        config.load(env={"WARMUP_AGENT_READINESS_MIN_PROBE": "3"})


@pytest.mark.parametrize("text, typo, suggestion", [
    ("readines:\n  min_probes: 3\n", "readines", "readiness"),        # a section: a section
    ("enigne: torch\n", "enigne", "engine"),                          # a top-level key
    ("prewarm:\n  prompt_lenghts: [8]\n", "prewarm.prompt_lenghts", "prewarm.prompt_lengths"),
])
def test_a_typo_is_compared_with_names_of_its_own_depth(tmp_path, text, typo, suggestion):
    with pytest.raises(ConfigError, match=rf"unknown key '{typo}'; did you mean '{suggestion}'\?$"):
        config.load(write(tmp_path, text), env={})


def test_env_value_is_checked_like_a_file_value():
    with pytest.raises(ConfigError, match="environment WARMUP_AGENT_READINESS_P90_THRESHOLD_SECONDS: key 'readiness.p90_threshold_seconds': got -2"):
        config.load(env={"WARMUP_AGENT_READINESS_P90_THRESHOLD_SECONDS": "-2"})


def test_yaml_syntax_error_gives_line_and_column(tmp_path):
    path = write(tmp_path, "readiness:\n  min_probes: [1, 2\n")
    with pytest.raises(ConfigError, match=r"YAML syntax error at line \d+, column \d+"):
        config.load(path, env={})


def test_missing_file_and_non_mapping(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config file"):
        config.load(str(tmp_path / "nope.yaml"), env={})
    with pytest.raises(ConfigError, match="expected a mapping"):
        config.load(write(tmp_path, "- a\n- b\n"), env={})


def test_reference_yaml_is_a_valid_config_with_every_key(tmp_path):
    text = config.reference_yaml()
    cfg = config.load(write(tmp_path, text), env={})
    for k in config.KEYS:
        assert k.env in text and k.path.split(".")[-1] + ":" in text
        if k.default is not None:
            assert cfg[k.path] == k.default


@pytest.mark.slow  # an agent process
def test_cli_bad_config_exits_2_with_one_line_and_no_traceback(tmp_path):
    path = write(tmp_path, "readiness:\n  p90_threshold_seconds: -1\n")
    for args in (("check-config", path), ("run", "--once", "--config", path)):
        r = run_agent(*args, timeout=120)
        assert r.returncode == 2, r.stderr
        assert "Traceback" not in r.stderr
        lines = [l for l in r.stderr.splitlines() if l.strip()]
        assert len(lines) == 1 and "readiness.p90_threshold_seconds" in lines[0] and "-1" in lines[0], r.stderr


@pytest.mark.slow  # an agent process
def test_cli_check_config_accepts_a_valid_file(tmp_path):
    r = run_agent("check-config", write(tmp_path, "readiness:\n  min_probes: 3\n"), timeout=60)
    assert r.returncode == 0 and "valid" in r.stdout


def test_cli_port_in_use_is_a_config_error(tmp_path, embedded_model, data_dir):
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = run_agent("run", "--once", "--data-dir", data_dir, "--listen", f"127.0.0.1:{port}", timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert f"exporter.listen': cannot listen on 127.0.0.1:{port}" in r.stderr


def test_docs_config_md_is_current():
    import os

    from tests.conftest import ROOT
    with open(os.path.join(ROOT, "docs", "config.md"), encoding="utf-8") as f:
        assert f.read() == config.reference_markdown(), "docs/config.md is stale: run `python -m warmup_agent.config`"


def test_reference_yaml_has_each_section_once():
    tops = [l.split(":")[0] for l in config.reference_yaml().splitlines() if l and not l.startswith((" ", "#"))]
    assert len(tops) == len(set(tops)), "a section appears twice: YAML would keep only the last one"


def test_config_sections_py_is_current():
    import os

    from tests.conftest import ROOT
    with open(os.path.join(ROOT, "warmup_agent", "config_sections.py"), encoding="utf-8") as f:
        assert f.read() == config.sections_source(), \
            "warmup_agent/config_sections.py is stale: run `python -m warmup_agent.config`"


def test_typed_sections_hold_every_key_and_a_typo_fails(clean_env, tmp_path):
    cfg = config.load(write(tmp_path, "readiness:\n  p90_threshold_seconds: 1.5\nprewarm:\n  batch_sizes: [2]\n"),
                      env={"WARMUP_AGENT_KERNEL_CACHE_KEY_PREFIX": "x:kc"})
    for k in config.KEYS:
        if "." in k.path:
            section, leaf = k.path.split(".", 1)
            assert getattr(getattr(cfg, section), leaf) == cfg[k.path], k.path
        else:
            assert getattr(cfg, k.path) == cfg[k.path], k.path
    assert cfg.readiness.p90_threshold_seconds == 1.5 and cfg.prewarm.batch_sizes == [2]
    assert cfg.kernel_cache.key_prefix == "x:kc"
    with pytest.raises(AttributeError):
        cfg.readiness.p90_threshold_secnds  # noqa: B018 - the typo is the point
    with pytest.raises(AttributeError):
        cfg.readyness  # noqa: B018
    with pytest.raises(AttributeError, match="read-only"):
        cfg.readiness.min_probes = 1
    assert cfg.readiness.min_probes == 10


def test_mypy_rejects_a_typo_in_a_config_attribute(tmp_path):
    """The point of the generated sections: a misspelt key is a type error, not a
    runtime surprise (mypy over a two-line module that uses the real Config)."""
    import subprocess
    import sys

    from tests.conftest import ROOT
    (tmp_path / "uses_config.py").write_text(
        "from warmup_agent.config import load\n"
        "ok: float = load().readiness.p90_threshold_seconds\n"
        "bad = load().readiness.p90_threshold_secnds\n")
    r = subprocess.run([sys.executable, "-m", "mypy", "--no-incremental", "--follow-imports=silent",
                        "--ignore-missing-imports", "--cache-dir", str(tmp_path / "cache"),
                        str(tmp_path / "uses_config.py")], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stdout + r.stderr
    assert '"ReadinessSection" has no attribute "p90_threshold_secnds"' in r.stdout, r.stdout
    assert r.stdout.count("error:") == 1, r.stdout


def test_an_environment_value_reads_as_yaml_would_without_importing_it_for_plain_ones():
    """config._env_value skips the YAML import for numbers, booleans and plain words (the
    early spawn comes sooner); what it returns is what YAML would have read."""
    import yaml

    from warmup_agent.config import _env_value
    for raw in ["1", "-3", "0", "0123", "1.5", "1.", "1e3", "0x10", "inf", "[1, 4]", "{a: 1}", "true", "Off", "yes",
                "null", "~", "auto", "/tmp/x.jsonl", "http://a:1", "a-b_c.d", "y", " 5 ", "[1]", "[ 16,24 ]", "[]",
                "[1e3]", "[1.5, 2]", "[true]", "[-2, 0]", "[1, a]"]:
        assert _env_value(raw) == yaml.safe_load(raw), raw
    assert _env_value("") is None and _env_value("  ") is None
