"""The engine's optional capabilities (engines/base.py): each has a default that
means "not this engine", and the callers rely on those defaults instead of asking
with hasattr.  Nothing here loads a model or starts a server."""
from __future__ import annotations

import ast
import os
from dataclasses import MISSING

import pytest

from exporter.engine_metrics import EngineMetricsCollector
from tests.helpers.engines import openai_engine
from tests.helpers.paths import ROOT
from warmup_agent import config
from warmup_agent.cli import connect_engine
from warmup_agent.engines.base import Engine, EngineFacts, RequestResult
from warmup_agent.engines.torch.engine import TorchEngine


class Minimal(Engine):
    """Only the abstract methods: every optional capability is the default."""
    name = "minimal"

    def load_tokenizer(self) -> None: pass
    def load_weights(self) -> None: pass
    def facts(self) -> EngineFacts: return EngineFacts("minimal", "m", "cpu", "float32")
    def tokenize(self, text: str) -> list[int]: return [1] * len(text.split())
    def generate(self, prompts, max_new_tokens=1, warmup=False):
        return [RequestResult(0.0, 0.0, len(p), 1) for p in prompts]
    def weight_fingerprint(self) -> str: return "f"


class Registry:
    """Stands in for the exporter's CollectorRegistry: records what is registered."""

    def __init__(self):
        self.collectors: list = []

    def register(self, collector) -> None:
        self.collectors.append(collector)


class AgentStub:
    def on_engine_exit(self, returncode: int) -> None: pass
    def on_engine_ready(self) -> None: pass


def test_the_defaults_say_this_engine_cannot():
    e = Minimal()
    assert e.model_path is None and e.metrics_url is None and e.torch_model() is None
    assert e.quantization is None and e.load_report is None and e.skeleton_wait_seconds is None
    assert not e.sets_up_device and e.context_seconds is None
    assert e.init_device() is None and e.reserve_memory(1 << 20) == 0
    assert e.configure(progressive=False, chunk_bytes=1) is None
    assert not e.speaks_profile and tuple(e.apis) == () and e.text is None and dict(e.capabilities) == {}
    with pytest.raises(NotImplementedError, match="minimal does not speak the traffic profile"):
        e.generate_requests([])
    assert e.has_compile_artifacts() is True       # solidify opens the kernel cache
    e.set_server_callbacks(lambda rc: None, lambda: None)   # no server: ignored
    e.interrupt()


def test_an_engine_without_a_server_gets_no_engine_collector():
    for engine in (Minimal(), TorchEngine("/nonexistent/model")):
        registry = Registry()
        connect_engine(engine, AgentStub(), registry)
        assert engine.metrics_url is None and registry.collectors == [], engine.name


def test_a_server_engine_gets_its_collector_and_the_crash_callbacks(clean_env):
    cfg = config.load(env={"WARMUP_AGENT_ENGINE": "openai", "WARMUP_AGENT_OPENAI_URL": "http://127.0.0.1:1/"})
    engine = openai_engine(cfg)
    agent, registry = AgentStub(), Registry()
    connect_engine(engine, agent, registry)
    assert engine.metrics_url == "http://127.0.0.1:1/metrics"
    assert len(registry.collectors) == 1 and isinstance(registry.collectors[0], EngineMetricsCollector)
    assert engine.server.on_server_exit == agent.on_engine_exit and engine.server.on_server_ready == agent.on_engine_ready
    assert engine.speaks_profile and engine.model_path is None   # no local model directory


def test_the_openai_engine_composes_its_parts_and_answers_for_them(clean_env):
    """Issue 42: OpenAIEngine is an Engine holding a server handle, a client and a
    discovery (none inherits from another), and the names callers use on the engine
    ask the part that knows."""
    from warmup_agent.engines.openai.engine import Discovery, OpenAIEngine, ServerHandle, StreamingClient
    assert OpenAIEngine.__bases__ == (Engine,)
    for part in (ServerHandle, StreamingClient, Discovery):
        assert part.__bases__ == (object,), part
    cfg = config.load(env={"WARMUP_AGENT_ENGINE": "openai", "WARMUP_AGENT_OPENAI_URL": "http://127.0.0.1:1/",
                           "WARMUP_AGENT_OPENAI_MODEL": "m", "WARMUP_AGENT_OPENAI_HEALTH_PATH": "ready"})
    e = openai_engine(cfg)
    try:
        assert isinstance(e.server, ServerHandle) and isinstance(e.client, StreamingClient)
        assert isinstance(e.discovery, Discovery) and e.discovery.client is e.client
        assert e.url == e.server.url == e.client.url == "http://127.0.0.1:1" and e.health_path == "/ready"
        assert e.model == e.client.model == "m"
        e.model = "n"                     # the served name requests carry lives in the client
        assert e.client.model == "n"
        assert e.apis == [] and e.concurrency == 1 and e.capabilities == {} and not e.discovery.token_id_prompts
        assert e.supervisor is None and e.server_start_seconds is None and e.server_name is None
        assert e.has_compile_artifacts()  # a server we did not start: we cannot tell
        assert e.client.headers(True)["X-Warmup"] == "true"
    finally:
        e.close()



def test_compile_artifacts_are_what_the_server_wrote_in_this_start(tmp_path, monkeypatch):
    """A supervised server's compile-cache folders count only for files written since
    this process started: a TORCHINDUCTOR_CACHE_DIR inherited from the environment, full
    of another program's files, made a llama.cpp start open the kernel cache (a torch
    import, 2 s on two cores) for nothing."""
    inherited = tmp_path / "torchinductor_root" / "precompiled_headers"
    inherited.mkdir(parents=True)
    old = inherited / "old.h"
    old.write_text("x")
    os.utime(old, (1_000_000_000, 1_000_000_000))           # 2001: long before this process
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "torchinductor_root"))
    cfg = config.load(env={"WARMUP_AGENT_ENGINE": "openai", "WARMUP_AGENT_DATA_DIR": str(tmp_path / "data")})
    e = openai_engine(cfg, server_command=["my-server", "--model", "x", "--port", "1"])
    try:
        assert e.has_compile_artifacts() is False
        (inherited / "new.h").write_text("y")                  # written now: this start's
        assert e.has_compile_artifacts() is True
    finally:
        e.close()
    # llama.cpp compiles nothing into those folders, supervised or beside the agent
    e = openai_engine(cfg, server_command=["llama-server", "-m", "x.gguf", "--port", "1"])
    try:
        assert e.has_compile_artifacts() is False
    finally:
        e.close()
    beside = config.load(env={"WARMUP_AGENT_ENGINE": "openai", "WARMUP_AGENT_OPENAI_URL": "http://127.0.0.1:1/",
                              "WARMUP_AGENT_DATA_DIR": str(tmp_path / "data")})
    for owner, compiles in (("llamacpp", False), ("vllm", True)):
        e = openai_engine(beside)
        try:
            e.discovery.models_info = {"owned_by": owner}       # what /v1/models said
            assert e.has_compile_artifacts() is compiles, owner
        finally:
            e.close()

def test_the_torch_engine_declares_what_it_can():
    e = TorchEngine("/some/model")
    assert e.model_path == "/some/model" and e.sets_up_device and not e.speaks_profile
    assert e.torch_model() is None                 # nothing loaded yet
    e.configure(chunk_bytes=4096, manifest=None)   # None keeps the default
    assert e.options["chunk_bytes"] == 4096 and e.options["manifest"] is None


def probes(names: tuple[str, ...]) -> list[str]:
    """hasattr/getattr calls in warmup_agent/ whose object is one of `names`
    (a bare name, or an attribute of that name: `agent.engine`)."""
    found = []
    for dirpath, _, files in os.walk(os.path.join(ROOT, "warmup_agent")):
        for f in sorted(files):
            if not f.endswith(".py"):
                continue
            path = os.path.join(dirpath, f)
            rel = os.path.relpath(path, ROOT)
            with open(path, encoding="utf-8") as fh:
                tree = ast.parse(fh.read())
            for node in ast.walk(tree):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("hasattr", "getattr"):
                    target = ast.unparse(node.args[0])
                    if target.split(".")[-1] in names:
                        found.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_capability_of_an_engine_is_probed_with_hasattr():
    """Issue 17: callers use the declarations on Engine, not hasattr/getattr on an engine."""
    # vllm_engine's own self.engine is vLLM's LLMEngine, not ours.
    found = [p for p in probes(("engine",)) if "getattr(self.engine, 'vllm_config'" not in p]
    assert not found, found


def test_stages_share_only_the_declared_context():
    """Issue 17: what stages hand each other is a field of StageContext, and every
    attribute a stage sets on the Agent is one that Agent.__init__ declares."""
    import dataclasses

    from warmup_agent.stages.context import StageContext
    shared = {f.name for f in dataclasses.fields(StageContext)}
    found = [p for p in probes(("agent", "self")) if p.split("'")[1] in shared]
    assert not found, found

    def assigned(tree, owner: str) -> set[str]:
        return {t.attr for node in ast.walk(tree) if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign))
                for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
                for t in (t.elts if isinstance(t, ast.Tuple) else [t])
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == owner}
    with open(os.path.join(ROOT, "warmup_agent", "pipeline.py"), encoding="utf-8") as fh:
        pipeline = ast.parse(fh.read())
    agent_init = next(n for c in pipeline.body if isinstance(c, ast.ClassDef) and c.name == "Agent"
                      for n in c.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    declared = assigned(agent_init, "self")
    stages = os.path.join(ROOT, "warmup_agent", "stages")
    for f in sorted(os.listdir(stages)):
        if f.endswith(".py"):
            with open(os.path.join(stages, f), encoding="utf-8") as fh:
                undeclared = assigned(ast.parse(fh.read()), "agent") - declared
            assert not undeclared, f"stages/{f} sets {sorted(undeclared)} on the Agent: a StageContext field?"



def test_nothing_probes_the_agent_or_itself_for_an_attribute():
    """Issue 17: the Agent declares what it holds in __init__ (`_watch`,
    `readiness`), so no code asks `getattr(agent, ...)` / `getattr(self, ...)`."""
    found = probes(("agent", "self"))
    assert not found, found


def test_stages_take_the_context_without_importing_the_pipeline():
    """Issues 17, 24: each stage is run(ctx, detail) with a StageContext: the pipeline
    imports the stages, never the other way (tests/test_stage_seams.py)."""
    import subprocess
    import sys
    stages = os.path.join(ROOT, "warmup_agent", "stages")
    beside = ["profile_warmup", "record"]   # not stages: the loop prewarm drives, the run record
    names = sorted(f[:-3] for f in os.listdir(stages)
                   if f.endswith(".py") and f not in ("__init__.py", "context.py") and f[:-3] not in beside)
    assert names == ["prewarm", "ready", "reserve", "solidify"]
    for name in names:
        with open(os.path.join(stages, name + ".py"), encoding="utf-8") as fh:
            tree = ast.parse(fh.read())
        run = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "run")
        assert [a.arg for a in run.args.args] == ["ctx", "detail"], name
        assert run.args.args[0].annotation is not None and ast.unparse(run.args.args[0].annotation) == "StageContext", name
    code = ("import sys\n"
            + "".join(f"import warmup_agent.stages.{n}\n" for n in names + beside)
            + "assert 'warmup_agent.pipeline' not in sys.modules, 'a stage imports the pipeline at run time'")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr

def test_the_agent_owns_one_context_with_empty_defaults(clean_env):
    from warmup_agent.pipeline import Agent
    from warmup_agent.stages.context import StageContext
    agent = Agent(config.load(env={}), Minimal())
    outputs = [f for f in StageContext.__dataclass_fields__.values() if f.default is not MISSING
               or f.default_factory is not MISSING]
    assert outputs and all(getattr(agent.context, f.name) == (f.default if f.default is not MISSING
                                                              else f.default_factory()) for f in outputs)
    assert agent.context.gpu is None and agent.context.warmed_shapes == [] and agent.context.kernel_cache is None
    assert agent.record()["traffic_profile"] is None
    agent.stop()                                   # no kernel cache opened: nothing to close
    assert not agent.driver.lock.locked()
