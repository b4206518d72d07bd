"""`warmup-agent` command line.

Exit codes: 0 ok, 2 usage or configuration error, 3 model or validation failure.
A user mistake gets one line on stderr, never a traceback.
"""
from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any

from warmup_agent import __version__
from warmup_agent.config import ConfigError  # early_spawn loads the configuration before a spawn anyway

# argparse, json and logging are imported where used: main() spawns a supervised
# server before they are imported (server/early_spawn.py).
if TYPE_CHECKING:  # the CLI imports these lazily: `--help` stays fast and imports no engine
    import argparse

    from exporter.server import ExporterServer
    from warmup_agent.config import Config
    from warmup_agent.engines.base import Engine
    from warmup_agent.pipeline import Agent
    from warmup_agent.proxy import ProxyProcess, RoutingProxy
    from warmup_agent.run.progress import Progress

EXIT_OK, EXIT_USAGE, EXIT_FAILED = 0, 2, 3

DESCRIPTION = """\
Cold-start warmup agent for LLM inference servers.

`run` takes a model server through four stages -- reserve (host facts, CPU
pinning, memory check), prewarm (tokenizer, weights, synthetic traffic over the
prompt-length x batch grid), solidify (replay / compile the warmed shapes) and
ready (probe time to first token until P50/P90 meet their thresholds) -- and
only then reports SERVING on /readyz.  Metrics on /metrics, progress on
/startupz.  With no --model it creates (once) and warms a small embedded Llama.
"""

EPILOG = """\
examples:
  warmup-agent run --once                      warm the embedded model, exit 0 at SERVING
  warmup-agent run --model ./Qwen2-1.5B --listen 0.0.0.0:9400
  warmup-agent run --config agent.yaml --record run.json
  warmup-agent check-config agent.yaml
  warmup-agent config-reference > agent.yaml   every key with its default
  warmup-agent cache stats                     what the kernel cache tiers hold
  warmup-agent bench -- llama-server -m m.gguf --port 8080   measure a server's cold start

exit codes: 0 ok, 2 usage or configuration error, 3 model or validation failure
"""


def build_parser() -> argparse.ArgumentParser:
    import argparse
    p = argparse.ArgumentParser(prog="warmup-agent", description=DESCRIPTION, epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"warmup-agent {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    run = sub.add_parser("run", help="warm a model server and serve readiness and metrics",
                         description=DESCRIPTION, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    run.add_argument("--config", metavar="FILE", help="YAML config file (see `config-reference`)")
    run.add_argument("--model", metavar="DIR", help="Hugging Face-layout model directory (default: the embedded model)")
    run.add_argument("--engine", choices=("torch", "vllm", "openai"), help="engine adapter (default: torch)")
    run.add_argument("--listen", metavar="HOST:PORT", help="exporter address (default 127.0.0.1:9400)")
    run.add_argument("--proxy-listen", metavar="HOST:PORT",
                     help="also run the cold-start-aware OpenAI proxy here (proxy.listen; see docs/readiness.md)")
    run.add_argument("--data-dir", metavar="DIR", help="where the embedded model and caches live")
    run.add_argument("--once", action="store_true", help="exit 0 as soon as SERVING is reached (3 on failure)")
    run.add_argument("--record", metavar="FILE", help="write the run (stages, probes, final state) as JSON")
    run.add_argument("--no-progress", action="store_true", help="no live progress display")
    run.add_argument("server_command", nargs=argparse.REMAINDER,
                     help="for --engine openai: `-- <server command...>` to start and supervise")

    chk = sub.add_parser("check-config", help="validate a config file and exit (0 valid, 2 invalid)")
    chk.add_argument("file", metavar="FILE")
    sub.add_parser("config-reference", help="print every config key with its default and documentation")
    from warmup_agent.kernel_cache import cli as cache_cli
    cache_cli.add_parser(sub)
    from warmup_agent.bench import cli as bench_cli
    bench_cli.add_parser(sub)
    rep = sub.add_parser("report", help="render a recorded run (--record) as PNG and HTML")
    from warmup_agent.run import report
    report.add_arguments(rep)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["run"]:
        from warmup_agent.server import reaper
        reaper.init_if_pid1()  # PID 1 of a container: fork, stay behind as init (server/reaper.py)
        # A supervised server starts before the agent's own imports (server/early_spawn.py).
        from warmup_agent.server import early_spawn
        early_spawn.start(argv)
    try:
        return _main(argv)
    finally:
        if argv[:1] == ["run"]:
            from warmup_agent.server import early_spawn
            early_spawn.discard()   # spawned early but never adopted: the run ended first


def _main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return EXIT_USAGE
    try:
        if args.command == "check-config":
            return cmd_check_config(args)
        if args.command == "report":
            from warmup_agent.run import report
            return report.run(args)
        if args.command == "cache":
            from warmup_agent.kernel_cache import cli as cache_cli
            return cache_cli.main(args)
        if args.command == "bench":
            from warmup_agent.bench import cli as bench_cli
            return bench_cli.main(args)
        if args.command == "config-reference":
            from warmup_agent.config import reference_yaml
            sys.stdout.write(reference_yaml())
            return EXIT_OK
        return cmd_run(args)
    except ConfigError as e:
        print(f"warmup-agent: config error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130


def cmd_check_config(args: Any) -> int:
    from warmup_agent import config
    cfg = config.load(args.file)
    for warning in cfg.warnings:
        print(f"warmup-agent: warning: {warning}", file=sys.stderr)
    overridden = sorted(k for k, v in cfg.sources.items() if v != "default")
    print(f"{args.file}: valid ({len(overridden)} keys set: {', '.join(overridden) or 'none'})")
    return EXIT_OK


def _setup_logging(level: str, fmt: str, progress: Any) -> None:
    import logging

    from warmup_agent.run.progress import JsonFormatter, ProgressAwareHandler
    handler = ProgressAwareHandler(progress, sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else
                         logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def _load(args: argparse.Namespace) -> tuple[Config, Progress]:
    """The configuration from the file, the environment and the flags; logging set
    up; the engine's extra checked."""
    from warmup_agent import config
    from warmup_agent.server import early_spawn
    flags = early_spawn.config_flags(args.model, args.engine, args.listen, args.data_dir, args.proxy_listen)
    # Loaded and checked already when a supervised server was spawned early.
    cfg = early_spawn.loaded_config(args.config, flags) or config.load(args.config, flags=flags)
    from warmup_agent.run.progress import Progress
    progress = Progress(sys.stderr, enabled=not args.no_progress)
    _setup_logging(cfg.log.level, cfg.log.format, progress)
    import logging
    for warning in cfg.warnings:   # of config.load's checks (prewarm.requests_file)
        logging.getLogger("warmup_agent").warning(warning)
    from warmup_agent.engines import check_installed
    check_installed(cfg.engine)  # a missing [torch]/[vllm] extra: one line, exit 2
    return cfg, progress


def _model_path(cfg: Config) -> str | None:
    """model.path; with the torch engine and none given, the embedded default (made once)."""
    model_path = cfg.model.path
    if model_path is None and cfg.engine == "torch":
        from warmup_agent.model.embedded import (
            embedded_model_dir,
            ensure_embedded_model,
        )
        if not os.path.exists(os.path.join(embedded_model_dir(cfg.data_dir), ".complete")):
            print(f"creating the embedded default model under {cfg.data_dir} (once)...", file=sys.stderr)
        model_path = ensure_embedded_model(cfg.data_dir)
    return model_path


def make_engine(cfg: Config, model_path: str | None, server_command: list[str] | None) -> Engine:
    """The engine `cfg.engine` names, handed the sections it reads (engines.create)."""
    from warmup_agent.engines import create
    check = cfg.requests_check
    return create(cfg.engine, model_path, server_command, model=cfg.model, openai=cfg.openai, vllm=cfg.vllm,
                  lora=cfg.lora, data_dir=cfg.data_dir, request_apis=check.endpoints if check is not None else ())


def _make_agent(cfg: Config, engine: Engine, progress: Progress) -> Agent:
    """The metrics registry with its collectors, the tracer, and the Agent on the
    process's clock, wired to the engine."""
    # No `_created` series: they double every counter and histogram in the text
    # format, which nothing here reads, and /metrics is served up to every second
    # while a warmup competes for the same interpreter.
    import prometheus_client

    from exporter.collectors import register_default_collectors
    from exporter.metrics import AgentMetrics
    from warmup_agent.pipeline import Agent
    prometheus_client.disable_created_metrics()
    metrics = AgentMetrics()
    register_default_collectors(metrics.registry)
    from warmup_agent.run import tracing
    from warmup_agent.server.procstart import process_started
    tracing.setup(cfg.tracing)   # start-up traces: NOOP (no OpenTelemetry import) unless tracing.enabled
    # The clock starts at process start: a first run's imports and embedded model
    # creation are part of the time to SERVING (the "startup" stage).
    agent = Agent(cfg, engine, metrics=metrics, progress=progress, process_started=process_started())
    if cfg.requests_check is not None:
        agent.recorder.requests_file(cfg.requests_check.bad_count)
    connect_engine(engine, agent, metrics.registry)
    return agent


def _serve_endpoints(cfg: Config, agent: Agent, engine: Engine, model_path: str | None,
                     main_url: str | None = None) -> tuple[ExporterServer, RoutingProxy | ProxyProcess | None]:
    """The exporter's server (started) and the proxy when proxy.listen asks for one;
    `main_url`: the proxy's main engine (preflight.main_url: proxy.upstream_url, or the
    openai engine's server, supervised or not)."""
    import logging

    from exporter.server import ExporterServer
    from warmup_agent import proxy as routing
    from warmup_agent import webconfig
    log = logging.getLogger("warmup_agent")
    # An engine that answers OpenAI requests in this process (the torch engine's
    # openai_backend()) is the proxy's main engine where no upstream URL is set.
    local_backend = None
    if cfg.proxy.listen and not cfg.proxy.upstream_url:
        engine.configure(batch_window_seconds=cfg.proxy.batch_window_seconds)
        local_backend = engine.openai_backend()
    from warmup_agent.server import early_spawn
    bound = early_spawn.take_listener(cfg.proxy.listen)     # users connected since the spawn wait in it
    proxy = routing.from_config(agent, cfg.proxy, main_url, local_backend, bound)  # None unless proxy.listen is set
    host, _, port = cfg.exporter.listen.rpartition(":")
    security = webconfig.resolve(cfg.exporter)   # TLS, basic auth, admin token: worked out here only
    try:
        server = ExporterServer(agent, agent.metrics.registry, host.strip("[]"), int(port), security=security).start()
    except OSError as e:
        if proxy is not None:
            proxy.stop()
        engine.close()     # a prestarted server must not outlive this error
        raise ConfigError(f"key 'exporter.listen': cannot listen on {cfg.exporter.listen}: {e.strerror}",
                          "exporter.listen") from None
    if proxy is not None:
        proxy.start()
        log.info("proxy on %s -> %s (fallback %s)", cfg.proxy.listen, proxy.main_name,
                 cfg.proxy.fallback_url or "none: 503 + Retry-After")
        if local_backend is not None:     # the model answers users in this process: warm their path too
            from warmup_agent.proxy import user_path
            at, timeout = (proxy.host, proxy.port), cfg.proxy.timeout_seconds
            agent.context.user_path_request = lambda: user_path.send(at[0], at[1], timeout)
    log.info("warmup-agent %s: engine %s, model %s, exporter on %s://%s:%d", __version__, cfg.engine,
             model_path, "https" if server.tls else "http", host, server.port)
    return server, proxy


def cmd_run(args: argparse.Namespace) -> int:
    server_command = [a for a in (args.server_command or []) if a != "--"] or None
    cfg, progress = _load(args)
    if server_command and cfg.engine != "openai":
        raise ConfigError(f"a server command after `--` needs --engine openai (engine is {cfg.engine})", "engine")
    from warmup_agent.server import early_spawn, preflight
    # Before any server starts (early_spawn made the same checks before its spawn, and
    # may hold proxy.listen since).
    preflight.check(cfg.engine, cfg.openai.url, cfg.exporter, cfg.proxy, server_command,
                    proxy_bound=early_spawn.holds_listener(cfg.proxy.listen))
    model_path = _model_path(cfg)

    from warmup_agent.engines import EngineError
    try:
        engine = make_engine(cfg, model_path, server_command)
    except EngineError as e:
        print(f"warmup-agent: {e.message}", file=sys.stderr)
        return EXIT_FAILED
    # A supervised server's start-up overlaps the rest of the agent's set-up (the
    # exporter's and the pipeline's imports, reserve) from here on: on a GPU host,
    # llama.cpp's server is up 1.2-1.5 s after its spawn.
    engine.prestart()
    agent = _make_agent(cfg, engine, progress)
    main_url = preflight.main_url(cfg.engine, cfg.openai.url, cfg.proxy, server_command)
    server, proxy = _serve_endpoints(cfg, agent, engine, model_path, main_url)

    # A warmup runs Python-heavy model code in this process; with the default 5 ms
    # GIL switch interval the exporter thread waits behind it, so /readyz and
    # /metrics answer late under load.  1 ms keeps them responsive.
    sys.setswitchinterval(0.001)
    from warmup_agent.run import tracing
    from warmup_agent.states import State

    def on_signal(signum: int) -> None:
        was = agent.sm.state
        if not was.terminal:  # a second signal, or one after FAILED, only stops
            agent.sm.transition(State.DRAINING)
        if was in (State.INIT, State.PRELOAD, State.PRIME):
            # Still warming: a server that is starting would otherwise be waited for
            # up to openai.ready_timeout_seconds before the drain could finish.
            engine.interrupt()
    # Not a bare signal.signal + Event.wait: see warmup_agent/host/signals.py for why
    # that never drained on the GPU hosts.
    from warmup_agent.host.signals import SignalWatcher
    signals = SignalWatcher(on_signal).install()

    try:
        state = agent.run()
        record = _record(agent, cfg)
        _write_record(args.record, record)
        print(_summary(record))
        if state == State.SERVING:
            import logging
            if args.once:
                return EXIT_OK
            logging.getLogger("warmup_agent").info("SERVING: /readyz is 200; probing every %gs; SIGTERM drains and "
                                                   "exits", cfg.readiness.watch_interval_seconds)
            agent.watch(cfg.readiness.watch_interval_seconds)
            signals.wait_until_stopped()
            return EXIT_OK
        if state == State.DRAINING:
            return EXIT_OK
        return EXIT_FAILED
    finally:
        agent.stop()
        signals.uninstall()
        _write_record(args.record, _record(agent, cfg))
        if proxy is not None:
            proxy.stop()
        server.stop()
        engine.close()
        tracing.shutdown()   # flush: waits at most tracing.export_timeout_seconds


def connect_engine(engine: Engine, agent: Agent, registry: Any) -> None:
    """Wire the engine's optional capabilities (engines/base.py) to the agent and
    the exporter's registry.  A supervised server that crashes sends the agent back
    to PRELOAD (readiness false at once); once it answers again the agent re-warms
    it; engines without a server ignore the callbacks.  An engine with its own
    Prometheus endpoint (metrics_url) gets a collector that reads it at scrape
    time, through every server kind's names (server/kinds.py); an engine without
    one (metrics_url None) gets none."""
    engine.set_server_callbacks(agent.on_engine_exit, agent.on_engine_ready)
    if engine.metrics_url is not None:
        from exporter.engine_metrics import EngineMetricsCollector
        from warmup_agent.server.signals import engine_metric_names
        registry.register(EngineMetricsCollector(lambda: engine.metrics_url, engine_metric_names()))


def _summary(record: dict) -> str:
    from warmup_agent.run.progress import summary_table
    return summary_table(record)


def _record(agent: Agent, cfg: Config) -> dict:
    """The run record, with what config.load's check of prewarm.requests_file found."""
    check = cfg.requests_check
    return {**agent.record(), "requests_file": None if check is None else {
        "path": check.path, "policy": cfg.prewarm.requests_file_bad_lines, "requests": check.good_count,
        "bad_lines": check.bad_lines()}}


def _write_record(path: str | None, record: dict) -> None:
    if not path:
        return
    from warmup_agent.atomic_file import write_json_atomic
    write_json_atomic(path, record, indent=2, default=str)


if __name__ == "__main__":
    raise SystemExit(main())
