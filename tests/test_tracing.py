"""Start-up traces (issue 27) checked against a real OTLP collector.

The collector is rotel (PyPI `rotel`, installed by the test extra): started on
loopback with its debug exporter, it prints every span it receives, which the
tests parse.  The agent runs as a real process on the embedded model, once per
OTLP transport (gRPC configured by `tracing.*` keys, HTTP by the standard
OTEL_EXPORTER_OTLP_* variables), once on a model directory that does not exist,
and side by side with tracing off and with the collector down.
"""
from __future__ import annotations

import datetime
import importlib.util
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.helpers.servers import free_port, stop_process, wait_until
from warmup_agent import config
from warmup_agent.run import tracing

HEX32 = re.compile(r"^[0-9a-f]{32}$")
STAGES = ["reserve", "prewarm", "solidify", "ready"]
OTEL_ENV_PREFIXES = ("WARMUP_AGENT_", "OTEL_")


# -- the collector -----------------------------------------------------------------------
def rotel_binary() -> str:
    spec = importlib.util.find_spec("rotel")
    path = os.path.join(os.path.dirname(spec.origin), "rotel-agent") if spec and spec.origin else ""
    if not os.access(path, os.X_OK):
        raise RuntimeError("rotel-agent not found: pip install -e '.[test]' (the test extra installs rotel)")
    return path


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


class Rotel:
    """rotel-agent on two free loopback ports, printing the spans it receives."""

    def __init__(self, tmp: Path):
        self.grpc_port, self.http_port = free_port(), free_port()
        self.out = tmp / "rotel.out"
        self._out = open(self.out, "w")
        self.proc = subprocess.Popen(
            [rotel_binary(), "start", "--otlp-grpc-endpoint", f"127.0.0.1:{self.grpc_port}",
             "--otlp-http-endpoint", f"127.0.0.1:{self.http_port}", "--exporter", "blackhole",
             "--debug-log", "traces", "--debug-log-verbosity", "detailed",
             "--pid-file", str(tmp / "rotel.pid"), "--log-file", str(tmp / "rotel.log")],
            stdout=self._out, stderr=subprocess.STDOUT)
        wait_until(lambda: self.proc.poll() is None and _listening(self.grpc_port) and _listening(self.http_port),
                   timeout=30, what="rotel listening")

    def spans(self) -> list[dict]:
        return parse_rotel(self.out.read_text(errors="replace"))

    def trace(self, trace_id: str, timeout: float = 20) -> list[dict]:
        """The spans of one trace, once its root has arrived (the root ends last)."""
        def root_in():
            spans = [s for s in self.spans() if s["trace_id"] == trace_id]
            return spans if any(not s["parent_id"] for s in spans) else None
        return wait_until(root_in, timeout=timeout, what=f"the root span of trace {trace_id}")

    def stop(self) -> None:
        stop_process(self.proc)
        self._out.close()


def _value(text: str):
    kind, _, rest = text.partition("(")
    inner = rest[:-1] if rest.endswith(")") else rest
    if kind == "Int":
        return int(inner)
    if kind == "Double":
        return float(inner)
    if kind == "Bool":
        return inner == "true"
    if kind == "Str":
        return inner
    return text  # Slice(...) and others: the printed text


def parse_rotel(text: str) -> list[dict]:
    """Spans from rotel's detailed debug log: ids, name, times (ns), status,
    attributes, and the resource attributes of the batch they came in."""
    spans: list[dict] = []
    resource: dict = {}
    span: dict | None = None
    section = None
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("ResourceSpans #"):
            resource, span, section = {}, None, "resource"
        elif line.startswith("Span #"):
            span = {"resource": resource, "attributes": {}}
            spans.append(span)
            section = "span"
        elif line.startswith("ScopeSpans #"):
            section = "scope"
        elif line == "Attributes:":
            section = "attributes"
        elif line.startswith("-> ") and section in ("resource", "attributes"):
            key, _, value = line[3:].partition(": ")
            (resource if section == "resource" else span["attributes"])[key] = _value(value)  # type: ignore[index]
        elif span is not None and ":" in line:
            key, _, value = (part.strip() for part in line.partition(":"))
            field = {"Trace ID": "trace_id", "Parent ID": "parent_id", "ID": "span_id", "Name": "name",
                     "Start time": "start", "End time": "end", "Status code": "status",
                     "Status message": "message"}.get(key)
            if field in ("start", "end"):
                span[field] = int(value)
            elif field:
                span[field] = value
    return spans


def test_parse_rotel_reads_its_detailed_output():
    text = """ResourceSpans #0
Resource attributes:
     -> service.name: Str(x)
ScopeSpans #0
InstrumentationScope w
Span #0
    Trace ID       : ec2808c73a30af5573bfe5e7678b4b4a
    Parent ID      : daf44a26630164a9
    ID             : 3fa05f53e467c75f
    Name           : child
    Kind           : SPAN_KIND_INTERNAL
Start time: 1796125578276847933
End time: 1796125578776847933
    Status code    : STATUS_CODE_ERROR
    Status message : bad: thing (really)
Attributes:
     -> a: Int(1)
     -> d: Double(1.5)
     -> s: Str(a (b))
"""
    [s] = parse_rotel(text)
    assert s["trace_id"] == "ec2808c73a30af5573bfe5e7678b4b4a" and s["parent_id"] == "daf44a26630164a9"
    assert s["name"] == "child" and s["end"] - s["start"] == 500_000_000
    assert s["status"] == "STATUS_CODE_ERROR" and s["message"] == "bad: thing (really)"
    assert s["attributes"] == {"a": 1, "d": 1.5, "s": "a (b)"} and s["resource"] == {"service.name": "x"}


@pytest.fixture(scope="module")
def rotel(tmp_path_factory):
    r = Rotel(tmp_path_factory.mktemp("rotel"))
    yield r
    r.stop()


# -- the agent ---------------------------------------------------------------------------
# Runs the CLI like `python -m warmup_agent`, and at exit writes the OpenTelemetry
# tracing SDK and exporter modules the process imported (tracing off must import
# none) and when the first was imported, in seconds from process start (the clock
# of time_to_ready_seconds).  Only those: redis>=8 imports the OpenTelemetry API
# and metrics SDK itself whenever they are installed, tracing on or off.
WRAPPER = """
import atexit, json, sys, time
OUT = sys.argv.pop(1)
OURS = ("opentelemetry.sdk.trace", "opentelemetry.exporter")
FIRST = []
class Watch:
    def find_spec(self, name, path=None, target=None):
        if not FIRST and name.startswith(OURS):
            FIRST.append(time.perf_counter())
sys.meta_path.insert(0, Watch())
def _otel():
    from warmup_agent.server.procstart import process_started
    with open(OUT, "w") as f:
        json.dump({"modules": sorted(m for m in sys.modules if m.startswith(OURS)),
                   "first_import_seconds": FIRST[0] - process_started() if FIRST else None}, f)
atexit.register(_otel)
from warmup_agent.cli import main
sys.exit(main(sys.argv[1:]))
"""
# A small warmup without deadlines: this shared test machine can be slow enough to
# miss the default PRELOAD deadline, which is not what these tests are about.
LIGHT = {"WARMUP_AGENT_PREWARM_PROMPT_LENGTHS": "[16, 32]", "WARMUP_AGENT_PREWARM_BATCH_SIZES": "[1, 2]",
         "WARMUP_AGENT_DEADLINES_INIT_SECONDS": "0", "WARMUP_AGENT_DEADLINES_PRELOAD_SECONDS": "0",
         "WARMUP_AGENT_DEADLINES_PRIME_SECONDS": "0"}


def run_agent(tmp: Path, name: str, data_dir: str, env: dict, *args: str) -> dict:
    """One `warmup-agent run --once`; its record, stderr, exit code, wall time and
    the opentelemetry modules it imported."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(OTEL_ENV_PREFIXES)}
    full_env.update(LIGHT)
    full_env.update(env)
    record, modules = tmp / f"{name}.json", tmp / f"{name}.modules.json"
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", WRAPPER, str(modules), "run", "--once", "--no-progress",
                        "--data-dir", data_dir, "--listen", "127.0.0.1:0", "--record", str(record), *args],
                       cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=300)
    wall = time.perf_counter() - t0
    return {"rc": p.returncode, "stderr": p.stderr, "wall": wall, "exited_at": datetime.datetime.now(),
            "record": json.loads(record.read_text()) if record.exists() else None,
            "otel": json.loads(modules.read_text()) if modules.exists() else None}


def coldstart_trace_ids(stderr: str) -> list[str | None]:
    lines = [line for line in stderr.splitlines() if "[COLDSTART]" in line]
    assert lines, stderr[-3000:]
    return [m.group(1) if (m := re.search(r" trace_id=(\S+)", line)) else None for line in lines]


def _seconds(span: dict) -> float:
    return (span["end"] - span["start"]) / 1e9


def _close(a: float, b: float, rel: float = 0.01) -> bool:
    return abs(a - b) <= max(rel * max(abs(a), abs(b)), 2e-6)


@pytest.fixture(scope="module", params=["grpc", "http/protobuf"])
def traced_run(request, rotel, embedded_model, data_dir, tmp_path_factory):
    """The agent warmed to SERVING with export on: gRPC configured by the tracing.*
    keys, HTTP by the standard OTEL_* variables (config keys left empty)."""
    protocol = request.param
    service = "warmup-test-" + protocol.split("/")[0]
    if protocol == "grpc":
        env = {"WARMUP_AGENT_TRACING_ENABLED": "true", "WARMUP_AGENT_TRACING_PROTOCOL": "grpc",
               "WARMUP_AGENT_TRACING_ENDPOINT": f"http://127.0.0.1:{rotel.grpc_port}"}
    else:
        env = {"WARMUP_AGENT_TRACING_ENABLED": "true", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
               "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{rotel.http_port}"}
    env.update(OTEL_SERVICE_NAME=service, OTEL_RESOURCE_ATTRIBUTES="k8s.pod.name=pod-a,k8s.node.name=node-1")
    run = run_agent(tmp_path_factory.mktemp("traced"), "traced", data_dir, env)
    assert run["rc"] == 0, run["stderr"][-3000:]
    trace_id = run["record"]["trace_id"]
    assert trace_id and HEX32.match(trace_id), run["record"].get("trace_id")
    run.update(protocol=protocol, service=service, spans=rotel.trace(trace_id))
    return run


def test_span_tree_matches_the_run_record(traced_run):
    record, spans = traced_run["record"], traced_run["spans"]
    assert record["final_state"] == "SERVING"
    by_id = {s["span_id"]: s for s in spans}
    [root] = [s for s in spans if not s["parent_id"]]
    assert root["name"] == "warmup.startup"
    assert all(s["parent_id"] in by_id for s in spans if s is not root), "every span's parent arrived"
    children = sorted((s for s in spans if s["parent_id"] == root["span_id"]), key=lambda s: s["start"])
    assert [s["name"] for s in children] == ["warmup.stage.startup"] + [f"warmup.stage.{n}" for n in STAGES]

    # durations: each stage span is the record's stage, within 1 %
    for span, stage in zip(children[1:], record["stages"], strict=True):
        assert span["attributes"]["warmup.stage"] == stage["name"]
        assert _close(_seconds(span), stage["duration_seconds"]), (span["name"], _seconds(span), stage)
        assert span["status"] != "STATUS_CODE_ERROR"
    assert _close(_seconds(children[0]), record["startup_seconds"])
    # the root is process start to SERVING, and the stages tile it
    assert _close(_seconds(root), record["time_to_ready_seconds"]), (_seconds(root), record["time_to_ready_seconds"])
    assert _close(sum(_seconds(s) for s in children), _seconds(root))
    assert children[0]["start"] == root["start"]
    for a, b in zip(children, children[1:], strict=False):
        assert abs(b["start"] - a["end"]) < 1_000_000, "stages are contiguous (within 1 ms)"

    # grandchildren: the timed steps the record holds
    def under(stage: str) -> list[str]:
        parent = next(s for s in children if s["name"] == f"warmup.stage.{stage}")
        return [s["name"] for s in sorted(spans, key=lambda s: s["start"]) if s["parent_id"] == parent["span_id"]]
    assert {"warmup.reserve.host_facts", "warmup.reserve.model_check"} <= set(under("reserve"))
    assert under("prewarm") == ["warmup.prewarm.weights", "warmup.prewarm.tokenizer",
                                "warmup.prewarm.fingerprint", "warmup.prewarm.traffic"]
    prewarm = record["stages"][1]
    for s in spans:
        if s["name"].startswith("warmup.prewarm."):
            step = s["name"].rsplit(".", 1)[1]
            assert _close(_seconds(s), prewarm["seconds"][step]), (step, _seconds(s), prewarm["seconds"])
    assert under("solidify") == [f"warmup.solidify.{record['stages'][2]['method']}"]
    assert under("ready") == ["warmup.ready.probe"] * record["probe_count"]
    probes = sorted((s for s in spans if s["name"] == "warmup.ready.probe"), key=lambda s: s["start"])
    assert [p["attributes"]["gen_ai.server.time_to_first_token"] for p in probes] == pytest.approx(record["probes_seconds"])
    # a grandchild lies inside its stage
    for s in spans:
        parent = by_id.get(s["parent_id"])
        if parent is not None and parent is not root:
            assert parent["start"] <= s["start"] and s["end"] <= parent["end"] + 1_000_000, s["name"]


def test_span_attributes(traced_run):
    record, spans = traced_run["record"], traced_run["spans"]
    [root] = [s for s in spans if not s["parent_id"]]
    a = root["attributes"]
    assert a["warmup.engine"] == "torch"
    assert a["gen_ai.request.model"] == os.path.basename(record["model"]) == "embedded-llama-v1"
    assert a["warmup.state"] == "SERVING"
    assert "error.type" not in a and root["status"] == "STATUS_CODE_UNSET"
    assert a["warmup.time_to_ready_seconds"] == pytest.approx(record["time_to_ready_seconds"])
    assert a["warmup.warmup_requests"] == record["warmup_requests"] > 0
    assert a["warmup.probe_count"] == record["probe_count"]
    assert a["warmup.first_request_tax_ratio"] == pytest.approx(record["first_request_tax_ratio"])
    traffic = next(s for s in spans if s["name"] == "warmup.prewarm.traffic")["attributes"]
    # the traffic step's requests are the prewarm stage's; the record's are every warmup
    # request, with the shape the ready stage re-sent before the first probe's control
    ready = next(s for s in record["stages"] if s["name"] == "ready")
    later = sum(p["replayed_requests"] for p in ready["first_probe_pairs"]) + ready.get("settle_requests", 0)
    assert traffic["warmup.requests"] == record["stages"][1]["requests"] == record["warmup_requests"] - later
    prewarm = next(s for s in spans if s["name"] == "warmup.stage.prewarm")["attributes"]
    assert prewarm["warmup.prewarm.shapes"] == record["stages"][1]["shapes"]
    assert prewarm["warmup.prewarm.weight_load.bytes"] == record["stages"][1]["weight_load"]["bytes"] > 0
    solidify = next(s for s in spans if s["name"] == "warmup.stage.solidify")["attributes"]
    assert solidify["warmup.solidify.method"] == record["stages"][2]["method"]
    # resource: OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES (the chart's pod and node)
    res = root["resource"]
    assert res["service.name"] == traced_run["service"]
    assert res["k8s.pod.name"] == "pod-a" and res["k8s.node.name"] == "node-1"
    assert res["service.version"] == record["version"]


def test_trace_id_joins_record_and_coldstart_lines(traced_run):
    trace_id = traced_run["record"]["trace_id"]
    ids = coldstart_trace_ids(traced_run["stderr"])
    assert set(ids) == {trace_id}, ids
    assert {s["trace_id"] for s in traced_run["spans"]} == {trace_id}
    assert f"OTLP {traced_run['protocol']}" in traced_run["stderr"]


def test_failed_start_is_an_error_span_with_its_reason(rotel, embedded_model, data_dir, tmp_path):
    run = run_agent(tmp_path, "failed", data_dir,
                    {"WARMUP_AGENT_TRACING_ENABLED": "true",
                     "WARMUP_AGENT_TRACING_ENDPOINT": f"http://127.0.0.1:{rotel.http_port}",
                     "WARMUP_AGENT_TRACING_PROTOCOL": "http/protobuf"},
                    "--model", str(tmp_path / "no-such-model"))
    record = run["record"]
    assert run["rc"] == 3 and record["final_state"] == "FAILED", run["stderr"][-3000:]
    assert record["failure_reason"] == "model_dir_missing"
    spans = rotel.trace(record["trace_id"])
    [root] = [s for s in spans if not s["parent_id"]]
    assert root["status"] == "STATUS_CODE_ERROR"
    assert root["message"].startswith("model_dir_missing: ") and record["failure_message"] in root["message"]
    assert root["attributes"]["error.type"] == "model_dir_missing"
    assert root["attributes"]["warmup.state"] == "FAILED"
    assert root["attributes"]["warmup.failure.reason"] == "model_dir_missing"
    stages = sorted((s for s in spans if s["parent_id"] == root["span_id"]), key=lambda s: s["start"])
    assert [s["name"] for s in stages] == ["warmup.stage.startup", "warmup.stage.reserve"], "no stage after the failure"
    reserve = stages[1]
    assert reserve["status"] == "STATUS_CODE_ERROR" and reserve["message"].startswith("model_dir_missing: ")
    assert reserve["attributes"]["error.type"] == "model_dir_missing"
    assert reserve["attributes"]["warmup.stage.status"] == "failed"
    assert _close(_seconds(reserve), record["stages"][0]["duration_seconds"])
    assert set(coldstart_trace_ids(run["stderr"])) == {record["trace_id"]}


# -- off, and a collector that is down ------------------------------------------------------
SERVING_AT = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) INFO warmup_agent.states: state PRIME -> SERVING", re.M)


def test_collector_down_costs_the_start_nothing(embedded_model, data_dir, tmp_path):
    """Tracing off imports no OpenTelemetry module.  With the collector down the
    start reaches SERVING, OpenTelemetry is not even imported before SERVING (the
    spans are made afterwards from the record), the failed export is logged once
    and the exit waits at most the export timeout.

    Side by side, alternating, time to ready is printed, not checked: on this shared
    2-core test machine the same run's time to ready varied from 40 to 52 s, and a
    gross-delay bound (1.5x) failed now and then on the neighbours' load alone.  The
    import-time check is the guarantee: the start itself runs no OpenTelemetry code
    before SERVING, so a dead collector cannot delay it."""
    dead = free_port()   # closed: nothing listens on it
    on_dead = {"WARMUP_AGENT_TRACING_ENABLED": "true", "WARMUP_AGENT_TRACING_PROTOCOL": "grpc",
               "WARMUP_AGENT_TRACING_ENDPOINT": f"http://127.0.0.1:{dead}",
               "WARMUP_AGENT_TRACING_EXPORT_TIMEOUT_SECONDS": "1"}
    runs: dict[str, list[dict]] = {"off": [], "dead": []}
    for i in range(2):
        runs["off"].append(run_agent(tmp_path, f"off{i}", data_dir, {}))
        runs["dead"].append(run_agent(tmp_path, f"dead{i}", data_dir, on_dead))
    for kind, rs in runs.items():
        for r in rs:
            assert r["rc"] == 0 and r["record"]["final_state"] == "SERVING", (kind, r["stderr"][-3000:])
    for r in runs["off"]:
        assert r["otel"]["modules"] == [], "tracing off imported OpenTelemetry"
        assert r["record"]["trace_id"] is None
        assert set(coldstart_trace_ids(r["stderr"])) == {None}
        assert "start-up traces" not in r["stderr"]
    for r in runs["dead"]:
        ttr = r["record"]["time_to_ready_seconds"]
        assert r["otel"]["modules"], "tracing on never imported the SDK"
        assert r["otel"]["first_import_seconds"] >= ttr, (r["otel"], ttr)
        assert HEX32.match(r["record"]["trace_id"])
        assert set(coldstart_trace_ids(r["stderr"])) == {r["record"]["trace_id"]}
        assert r["stderr"].count("start-up traces: export to") == 1, r["stderr"][-3000:]
        serving = datetime.datetime.strptime(SERVING_AT.search(r["stderr"]).group(1), "%Y-%m-%d %H:%M:%S,%f")
        assert (r["exited_at"] - serving).total_seconds() < 1 + 5.0, "exit waited past the export timeout"
    print(f"time to ready: off {[round(r['record']['time_to_ready_seconds'], 3) for r in runs['off']]}, "
          f"collector down {[round(r['record']['time_to_ready_seconds'], 3) for r in runs['dead']]}")


# -- settings, without a collector ------------------------------------------------------------
def _cfg(**values):
    """The `tracing.*` section, as config.load makes it from these keys."""
    return config.load(env={f"WARMUP_AGENT_TRACING_{k.upper()}": v for k, v in values.items()}).tracing


def test_off_by_default_and_setup_imports_nothing():
    cfg = config.load(env={})
    assert cfg["tracing.enabled"] is False and not tracing.enabled(cfg.tracing, {})
    assert not tracing.enabled(_cfg(enabled="true"), {"OTEL_SDK_DISABLED": "true"})
    code = ("import sys; from warmup_agent import config; from warmup_agent.run import tracing; "
            "t = tracing.setup(config.load(env={}).tracing); "
            "assert t is tracing.NOOP and tracing.current_trace_id() is None; "
            "import warmup_agent.pipeline, warmup_agent.cli; "
            "import warmup_agent.stages.solidify, warmup_agent.run.progress; "
            "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("values, env, want", [
    ({}, {}, ("grpc", "http://localhost:4317")),
    ({"protocol": "http/protobuf"}, {}, ("http/protobuf", "http://localhost:4318/v1/traces")),
    ({"endpoint": "collector:4317"}, {}, ("grpc", "http://collector:4317")),
    ({"endpoint": "https://c.example:4318/", "protocol": "http/protobuf"}, {}, ("http/protobuf", "https://c.example:4318/v1/traces")),
    ({}, {"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"},
     ("http/protobuf", "http://c:4318/v1/traces")),
    ({}, {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
          "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://t:4317", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"},
     ("grpc", "http://t:4317")),
    ({"endpoint": "http://cfg:4317"}, {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://t:4317"}, ("grpc", "http://cfg:4317")),
])
def test_settings_from_keys_and_standard_variables(values, env, want):
    s = tracing.settings(_cfg(**values), env)
    assert (s.protocol, s.endpoint) == want
    assert s.service_name == "warmup-agent" and s.timeout == 2.0
    assert tracing.settings(_cfg(), {"OTEL_SERVICE_NAME": "pod-x"}).service_name == "pod-x"


def test_enabled_without_the_extra_is_one_warning_and_no_tracer(monkeypatch, caplog):
    monkeypatch.setattr(tracing, "installed", lambda d: d != "opentelemetry-exporter-otlp-proto-http")
    with caplog.at_level("WARNING", logger="warmup_agent.tracing"):
        assert tracing.setup(_cfg(enabled="true", protocol="http/protobuf"), {}) is tracing.NOOP
    assert "opentelemetry-exporter-otlp-proto-http is not installed" in caplog.text
    assert "warmup-agent[otel]" in caplog.text and tracing.active() is tracing.NOOP


def test_bad_protocol_is_a_config_error():
    with pytest.raises(config.ConfigError, match="tracing.protocol"):
        _cfg(protocol="thrift")


def test_flatten_keeps_scalars_and_lists():
    out = tracing.flatten("warmup.x", {"a": 1, "b": {"c": "s", "d": {"e": 2.5, "f": {"g": 1}}}, "l": [1, 2],
                                       "mixed": [1, "a"], "none": None, "empty": []})
    assert out == {"warmup.x.a": 1, "warmup.x.b.c": "s", "warmup.x.b.d.e": 2.5, "warmup.x.l": [1, 2]}


def test_a_rewarm_is_a_trace_of_its_own(rotel, embedded_model, caplog):
    """In process: run to SERVING, then re-warm (as POST /admin/rewarm does, but in
    this thread).  Two traces: the start-up's, which stays the record's trace ID,
    and the re-warm's, rooted at warmup.rewarm, with its own probes only."""
    from exporter.metrics import AgentMetrics
    from warmup_agent.engines.torch.engine import TorchEngine
    from warmup_agent.pipeline import Agent
    from warmup_agent.states import State
    cfg = config.load(env={**LIGHT, "WARMUP_AGENT_READINESS_MIN_PROBES": "3", "WARMUP_AGENT_TRACING_ENABLED": "true",
                           "WARMUP_AGENT_TRACING_ENDPOINT": f"http://127.0.0.1:{rotel.grpc_port}"})
    tracer = tracing.setup(cfg.tracing, {})
    try:
        assert isinstance(tracer, tracing.OtlpTracing)
        agent = Agent(cfg, TorchEngine(embedded_model, dtype="float32", device="cpu"), metrics=AgentMetrics())
        with caplog.at_level("INFO", logger="warmup_agent.coldstart"):
            assert agent.run() == State.SERVING
            first_probes = len(agent.probes)
            assert agent.sm.transition(State.PRELOAD)
            assert agent.rewarm() == State.SERVING
        agent.stop()
    finally:
        tracing.shutdown()
    assert tracing.active() is tracing.NOOP
    startup_id = agent.record()["trace_id"]
    rewarm_ids = {m.group(1) for r in caplog.records if (m := re.search(r"trace_id=(\w+)", r.getMessage()))} - {startup_id}
    assert len(rewarm_ids) == 1, "the re-warm's [COLDSTART] lines carry one other trace ID"
    rewarm_id = rewarm_ids.pop()

    startup = rotel.trace(startup_id)
    [root] = [s for s in startup if not s["parent_id"]]
    assert root["name"] == "warmup.startup"
    # no process start known in process: no startup stage, the root starts at run()
    assert sorted((s["name"] for s in startup if s["parent_id"] == root["span_id"])) == \
        sorted(f"warmup.stage.{n}" for n in STAGES)
    assert [s["name"] for s in startup].count("warmup.ready.probe") == first_probes

    again = rotel.trace(rewarm_id)
    [root] = [s for s in again if not s["parent_id"]]
    assert root["name"] == "warmup.rewarm" and root["attributes"]["warmup.state"] == "SERVING"
    stages = sorted((s for s in again if s["parent_id"] == root["span_id"]), key=lambda s: s["start"])
    assert [s["name"] for s in stages] == ["warmup.stage.prewarm", "warmup.stage.solidify", "warmup.stage.ready"]
    assert root["start"] == stages[0]["start"] and root["end"] >= stages[-1]["end"]
    for span, timing in zip(stages, agent.stages[-3:], strict=True):
        assert _close(_seconds(span), timing.duration)
    assert [s["name"] for s in again].count("warmup.ready.probe") == len(agent.probes) - first_probes
