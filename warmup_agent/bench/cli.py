"""`warmup-agent bench`: the command line.  warmup_agent/cli.py registers it
with `add_parser(subparsers)` and dispatches to `main(args)`."""
from __future__ import annotations

import argparse
import os
import random
import sys
from typing import TYPE_CHECKING, Any

from warmup_agent.bench.traffic import CONDITIONS, Traffic, TrafficError, load_requests_file
from warmup_agent.run.progress import Progress
from warmup_agent.server.command import fix_command, option, reach_host
from warmup_agent.server.kinds import kind_of_command

# The measuring modules (urllib.request, matplotlib) load in main(): `warmup-agent run`
# builds this parser too, before it spawns a supervised server.
if TYPE_CHECKING:
    from warmup_agent.bench.start import Setup

EXIT_OK, EXIT_USAGE, EXIT_FAILED, EXIT_INTERRUPTED = 0, 2, 3, 130

DESCRIPTION = """\
Measure your own server's cold start as its users meet it, and whether the
agent pays off.  The bench starts SERVER COMMAND again and again, alternating
three conditions, and measures each start from outside with streamed chat
requests:

  alone    the server by itself: ready when its health endpoint answers 200
  oneshot  the simplest warmup: one 1-token request at health, ready when answered
  agent    `warmup-agent run --engine openai -- SERVER COMMAND`: ready at /readyz;
           every request goes through the agent's proxy, as users reach the pod

Per start: time to ready; the first request's time to first token and whole
answer over the median of the next ones (the first-request tax; the whole
answer over a steady one of as many tokens); two controls on the warm server
(the same shape after a quiet pause: the tax's noise floor; a prompt longer
than any before it); a burst of concurrent requests; a prompt length inside
the traffic's range that the start has not sent, twice.  Under the agent: the
users' first-request tax it measured at its proxy and its probes' prediction,
each over the measured one; its warm-up behind the users, waited for, and the
requests sent beside it over those after it; its warm-up's seconds over its
budget.  Then SIGTERM to exit, and processes left behind.  Prompts are
drawn by a seeded generator (--seed; printed and recorded), from the requests
file or a built-in mix of lengths, every one a new prefix no cache can answer.

Writes DIR/bench.json, DIR/report.html, DIR/report.png (with matplotlib) and
DIR/logs/ (each start's output).  The server's address is its command's --host
and --port; write {port} in the command to get a free port for each start.
"""

EPILOG = """\
examples:
  warmup-agent bench --starts 3 -- llama-server -m model.gguf --port 8080
  warmup-agent bench --conditions alone,agent --requests-file traffic.jsonl \\
      -- vllm serve Qwen/Qwen2-1.5B --port {port}
  warmup-agent bench --config agent.yaml --seed 7 --out bench-out -- transformers serve DIR --port 8000

exit codes: 0 all starts measured, 2 usage error, 3 a start failed (the partial
results are written), 130 interrupted (Ctrl-C; partial results written)
"""


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("bench", help="measure a server's cold start alone, with one warm-up request, "
                              "and under the agent", description=DESCRIPTION, epilog=EPILOG,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--conditions", default="alone,oneshot,agent", metavar="LIST",
                   help="comma-separated, of alone, oneshot, agent (default: all three)")
    p.add_argument("--starts", type=int, default=3, metavar="N", help="starts per condition (default 3)")
    p.add_argument("--requests-file", metavar="FILE",
                   help="JSON Lines of OpenAI request bodies to draw prompts from (also given to the agent)")
    p.add_argument("--config", metavar="FILE", help="the agent's config file for the agent condition")
    p.add_argument("--seed", type=int, help="seed of the prompt draws (default: a new one, printed)")
    p.add_argument("--out", default="warmup-bench", metavar="DIR", help="output directory (default warmup-bench)")
    p.add_argument("--model", metavar="NAME", help="model name the requests send (default: from the command)")
    p.add_argument("--agent-model", metavar="DIR", help="model directory for the agent (`run --model`)")
    p.add_argument("--health-path", default="/health", metavar="PATH", help="health endpoint (default /health)")
    p.add_argument("--ready-timeout", type=float, default=600.0, metavar="S",
                   help="seconds a start may take to get ready (default 600)")
    p.add_argument("--steady", type=int, default=8, metavar="N", help="requests after the first (default 8)")
    p.add_argument("--idle", type=float, default=2.0, metavar="S",
                   help="seconds of quiet before the warm control request (default 2)")
    p.add_argument("--burst", type=int, default=4, metavar="N", help="concurrent requests at the end (default 4)")
    p.add_argument("--max-context", type=int, metavar="TOKENS",
                   help="built-in prompts plus answers fit this context, per request (default: what the "
                        "server gives each of the burst's requests at once, at most 2048: read from its "
                        "command line, e.g. vLLM's --max-model-len, llama-server's -c shared by its slots, "
                        "else from the server, started alone once before the measured starts)")
    p.add_argument("--max-tokens", type=int, default=32, metavar="N", help="longest built-in answer (default 32)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("server_command", nargs=argparse.REMAINDER, metavar="-- SERVER COMMAND...",
                   help="the server to start, after --")
    p.set_defaults(func=main)
    return p


class UsageError(Exception):
    """A bad argument; str() is the one line to show."""


def model_name(command: list[str]) -> str | None:
    """The name the server answers to, from its command line."""
    for flag in ("--served-model-name", "--alias"):
        if (v := option(command, flag)) is not None:
            return v
    words = [os.path.basename(w) for w in command[:3]]
    if "serve" in words:       # `vllm serve MODEL`, `transformers serve MODEL`
        i = words.index("serve") + 1
        if i < len(command) and not command[i].startswith("-"):
            return command[i]
    return option(command, "--model") or option(command, "-m") or option(command, "--model-path")


def server_label(command: list[str]) -> str:
    """The server's name as its users write it (server/kinds.py), else its program's name."""
    kind = kind_of_command(command)
    if kind is None:
        return os.path.basename(command[0])
    return str(getattr(kind, "label", None) or kind.name)


def parse_conditions(text: str) -> list[str]:
    conds = [c.strip() for c in text.split(",") if c.strip()]
    bad = [c for c in conds if c not in CONDITIONS]
    if bad or not conds or len(set(conds)) != len(conds):
        raise UsageError(f"--conditions {text!r}: expected a comma-separated list of {', '.join(CONDITIONS)}")
    return conds


def _setup(args: Any, command: list[str]) -> Setup:
    from warmup_agent.bench.start import Setup
    host = reach_host((option(command, "--host") or "127.0.0.1").strip("[]"))
    port_text = option(command, "--port")
    if port_text is None and not any("{port}" in w for w in command):
        raise UsageError("the server command has no --port: give it one (--port 8000), or --port {port} "
                         "for a free port per start")
    port = None if port_text is None or "{port}" in port_text else int(port_text)
    agent_args = (["--config", args.config] if args.config else []) + (
        ["--model", args.agent_model] if args.agent_model else [])
    agent_env = {"WARMUP_AGENT_PREWARM_REQUESTS_FILE": os.path.abspath(args.requests_file)} if args.requests_file else {}
    return Setup(command=command, host=host, port=port, model=args.model or model_name(command),
                 health_path=args.health_path, ready_timeout=args.ready_timeout, steady=args.steady,
                 idle=args.idle, burst=args.burst, logs=os.path.join(args.out, "logs"), agent_args=agent_args, agent_env=agent_env)


def _check(args: Any) -> tuple[list[str], list[str]]:
    command = list(args.server_command)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        raise UsageError("no server command: give it after --, e.g. -- llama-server -m model.gguf --port 8080")
    if args.starts < 1 or args.steady < 1 or args.burst < 0 or args.idle < 0:
        raise UsageError("--starts and --steady must be at least 1, --burst and --idle at least 0")
    if args.max_context is not None and args.max_context < 1:
        raise UsageError("--max-context must be at least 1")
    if args.config and not os.path.isfile(args.config):
        raise UsageError(f"--config {args.config}: no such file")
    return command, parse_conditions(args.conditions)


def main(args: Any) -> int:
    from warmup_agent.bench import conditions as loop
    from warmup_agent.bench.report import table
    """Entry point of `warmup-agent bench`; returns the exit code."""
    try:
        command, conds = _check(args)
        setup = _setup(args, command)
        bodies = load_requests_file(args.requests_file) if args.requests_file else []
    except (UsageError, TrafficError, ValueError) as e:
        print(f"warmup-agent bench: {e}", file=sys.stderr)
        return EXIT_USAGE
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    setup.command = fix_command(command)   # `vllm serve` as the agent would start it
    from warmup_agent.bench import context
    try:
        fit = context.resolve(args.max_context, setup, args.burst,
                              lambda line: print(f"warmup-agent bench: {line}", file=sys.stderr), needed=not bodies)
    except KeyboardInterrupt:
        print("warmup-agent bench: interrupted while reading the server's context", file=sys.stderr)
        return EXIT_INTERRUPTED
    traffic = Traffic(seed, max_context=fit.tokens, max_tokens=args.max_tokens, file_bodies=bodies)
    head = {"tool": "warmup-agent bench", "server": server_label(command),
            "server_command": command, "conditions": conds, "starts_per_condition": args.starts,
            "seed": seed, "traffic": {"source": args.requests_file or "built-in mix", "steady": args.steady,
                                      "idle_seconds": args.idle, "burst": args.burst, "max_context": fit.tokens,
                                      "context": fit.as_dict()},
            "model": setup.model}
    from warmup_agent.bench.summary import provenance
    head.update(provenance())
    print(f"warmup-agent bench: {head['server']}, conditions {','.join(conds)}, {args.starts} start(s) each, "
          f"seed {seed}, prompts and answers within {fit.tokens} tokens ({fit.source})", file=sys.stderr)
    outcome = loop.run(setup, traffic, conds, args.starts, args.out, head,
                       Progress(enabled=not args.no_progress))
    print(table(outcome.result))
    if outcome.error:
        print(f"warmup-agent bench: {outcome.error}", file=sys.stderr)
    print(f"wrote {', '.join(outcome.files)}", file=sys.stderr)
    return {"complete": EXIT_OK, "failed": EXIT_FAILED}.get(outcome.status, EXIT_INTERRUPTED)


def standalone(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="warmup-agent")
    add_parser(p.add_subparsers(dest="command"))
    return main(p.parse_args(["bench", *(sys.argv[1:] if argv is None else argv)]))


if __name__ == "__main__":
    sys.exit(standalone())
