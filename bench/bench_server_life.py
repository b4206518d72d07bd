"""The pod's whole life after SERVING, measured from outside (issue 58).

    python bench/bench_server_life.py --server llamacpp --runs 3 [--seed N] [--out JSON]
    python bench/bench_server_life.py --server vllm --parts restart,hang --runs 3
    python bench/bench_server_life.py --server llamacpp --llama-server BIN --gguf M.gguf \
        --model DIR --gpu-layers 99 --parts restart,hang,sleep,idle --idle-seconds 120   # a GPU
    python bench/bench_server_life.py --parts learned --runs 3 [--idle-seconds 120] [--usage]

A real server beside a real `warmup-agent run` (sidecar: the agent watches a server
it did not start), and an outside client that sends the users' requests: streamed
chats of one shape per run, drawn by a seeded generator (warmup_agent/bench/traffic.py),
each with a fresh prefix so no prompt cache answers it.  The agent's profile is that
traffic as a gateway log gives it (prewarm.requests_file, one line per shape).  A request's time to first
token over the median of the 5 that follow it is its tax.

  restart  the server is killed (SIGKILL) and started again on its port.  Out: seconds
           from the kill to /readyz 503.  Back: the agent must pass PRIME (a re-warm)
           before /readyz is 200; then the users' first request.  A warm control in the
           same run: the same server left idle as long, then its first request.
  hang     SIGSTOP for --hang-seconds, then SIGCONT; the client polls the server's
           /health every 10 ms and the agent's /readyz: SERVING again how long after
           the server answered again.
  sleep    llama-server --sleep-idle-seconds N, alone and under the agent, one after
           the other (alternating which goes first): the share of an idle period it
           sleeps, the wakes the server logs during it (the agent's probes must wake it
           0 times), then a wake ahead (POST /admin/wake) and a wake on demand (a
           user's request through the agent's proxy), each with its tax; the exported
           wake duration and first request after the wake beside the client's.
  idle     no sleep: the same server alone and under the agent, each left idle
           --idle-seconds, then its first request (low traffic, issue 58's H200 check).

  learned  the agent with its default config (no requests file) learns the users' traffic
           through its proxy: --learn-requests chats of about --learned-prompt-tokens
           tokens (counted by the server's tokenizer), its Redis shared tier on.  Then the
           users' first request through the proxy, over the 5 after it (issue 72): after
           --idle-seconds of quiet (idle_first_ttft_tax); after a restart of the server
           (learned_first_ttft_tax_after_restart); the agent and the server stopped and
           started again with the same data dir (.._new_start), the server now sleeping
           when idle; after a wake ahead (.._after_wake); a wake ahead without waiting
           (?wait=false) and a request at once, held by the proxy until warm (issue 71's
           wake_ahead_held_first_ttft_tax: the client's TTFT less the exported hold; the
           client's whole wait beside it); a second agent with a new data dir and the same
           Redis (.._shared).  For comparison, an agent that learned nothing (the default
           grid) after a wake ahead.  Each a median and max over --runs, against 1.2.

Writes the figures issue 58 names (restart_first_ttft_tax_median, restart_rewarmed,
hang_back_after_server_s_max, sleep_share_agent_over_alone, probe_wakes,
wake_ahead_first_ttft_tax_median, wake_on_demand_first_ttft_tax_over_alone,
draw_seed) and more, to bench/results/server_life_<server>_<date>.json.
"""
from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import random
import re
import shutil
import signal
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.provenance import gpu_name, provenance, write_result  # noqa: E402
from warmup_agent.bench.client import RequestFailed, get_json, get_status, stream_chat  # noqa: E402
from warmup_agent.bench.process import Started, free_port, kill_now, spawn, stop  # noqa: E402
from warmup_agent.bench.traffic import WORDS, Shape, Traffic  # noqa: E402

STEADY = 5
TOKEN = "a-bench-admin-token-0123456789"
SECRET = "a-bench-kernel-cache-secret-0123456789"   # the shared tier's HMAC key (learned)
AGENT_WATCH_INTERVAL = 5.0   # readiness.watch_interval_seconds' default: the learned part's agents
TARGET = 1.2                 # issue 72: the users' first request <= 1.2x steady


class Setup:
    """How to start the server and the agent for this run."""

    def __init__(self, args: argparse.Namespace, scratch: str, traffic: Traffic):
        self.args = args
        self.scratch = scratch
        # The agent's profile is the users' traffic, as an operator gives it from a
        # gateway log (prewarm.requests_file): one line per run's shape.  The client's
        # requests have other words and prefixes, so no prompt cache answers them.
        self.requests_file = os.path.join(scratch, "requests.jsonl")
        with open(self.requests_file, "w") as f:
            for i in range(max(args.runs, args.idle_runs or 0)):
                f.write(json.dumps(traffic.request(traffic.shape(i))) + "\n")
        self.client_model: str | None = None
        self.learned_words: int | None = None     # the learned part's prompt, counted once
        self.learned_tokens: int | None = None
        if args.server == "vllm":
            from tests.helpers import vllm_server as vs
            self.model = args.model or vs.tiny_model(os.path.join(scratch, "data"))
            self.client_model = vs.SERVED_NAME
        else:
            from warmup_agent.model.embedded import ensure_embedded_model
            self.model = args.model or ensure_embedded_model(args.data_dir)
        if args.server == "llamacpp":
            from tests.helpers import llamacpp_server as ls
            self.binary = args.llama_server or ls.ensure_binary()
            self.gguf = args.gguf or ls.ensure_gguf(self.model)
        self.token = os.path.join(scratch, "token")
        with open(self.token, "w") as f:
            f.write(TOKEN + "\n")

    def server(self, port: int, name: str, sleep_idle: int | None = None) -> Started:
        extra: tuple[str, ...] = ("--sleep-idle-seconds", str(sleep_idle)) if sleep_idle else ()
        home = tempfile.mkdtemp(prefix="home-", dir=self.scratch)
        if self.args.server == "llamacpp":
            from tests.helpers import llamacpp_server as ls
            # -c is shared by its slots (4 by default): each slot holds the traffic's context
            cmd = ls.server_command(self.binary, self.gguf, port, ctx=4 * self.args.max_context,
                                    gpu_layers=self.args.gpu_layers, extra=extra)
            env = ls.server_env(home)
        else:
            from tests.helpers import vllm_server as vs
            cmd, env = vs.server_command(self.model, port), vs.server_env(home)
        return spawn(cmd, os.path.join(self.args.logs, f"{name}.log"), env=env)

    def agent(self, server_url: str, name: str, sleeps: bool = False, learned: bool = False,
              data_dir: str | None = None, redis_url: str | None = None) -> tuple[Started, str, str]:
        """The agent beside the server.  learned: the default config (no requests file, the
        default watch interval unless --watch-interval is given), learning the users' traffic
        through its proxy; redis_url: the kernel cache's shared tier, where the profile is shared."""
        listen, proxy = free_port(), free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("WARMUP_AGENT_")}
        env.update(WARMUP_AGENT_OPENAI_URL=server_url, WARMUP_AGENT_EXPORTER_ADMIN_TOKEN_FILE=self.token,
                   WARMUP_AGENT_OPENAI_SERVER_SLEEPS="yes" if sleeps else "auto")
        if not learned:
            env["WARMUP_AGENT_PREWARM_REQUESTS_FILE"] = self.requests_file
        if not learned or self.args.watch_given:
            env["WARMUP_AGENT_READINESS_WATCH_INTERVAL_SECONDS"] = str(self.args.watch_interval)
        if redis_url:
            env.update(WARMUP_AGENT_KERNEL_CACHE_REDIS_URL=redis_url, WARMUP_AGENT_KERNEL_CACHE_SECRET=SECRET)
        if self.client_model:
            env["WARMUP_AGENT_OPENAI_MODEL"] = self.client_model
        cmd = [sys.executable, "-m", "warmup_agent", "run", "--no-progress", "--engine", "openai", "--model", self.model,
               "--data-dir", data_dir or os.path.join(self.scratch, "agent-data"), "--listen", f"127.0.0.1:{listen}",
               "--proxy-listen", f"127.0.0.1:{proxy}"]
        return (spawn(cmd, os.path.join(self.args.logs, f"{name}.log"), env=env, cwd=ROOT),
                f"http://127.0.0.1:{listen}", f"http://127.0.0.1:{proxy}")


@dataclass
class Pod:
    """A server on its port and, under the agent, the agent beside it."""
    port: int
    server: Started                 # the latest process: a restart replaces it
    agent: Started | None = None
    url: str = ""                   # the agent's /readyz, /metrics, /admin
    users: str = ""                 # the agent's proxy

    @property
    def server_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@contextlib.contextmanager
def pod(setup: Setup, name: str, under_agent: bool, sleep_idle: int | None = None,
        sleeps: bool = False, **agent: Any) -> Iterator[Pod]:
    """Start the server (answering /health) and, under_agent, the agent (SERVING; `agent`:
    Setup.agent's learned, data_dir, redis_url); stop both after."""
    a = setup.args
    port = free_port()
    p = Pod(port, setup.server(port, f"{name}-server", sleep_idle=sleep_idle))
    try:
        wait_for(lambda: get_status(p.server_url + "/health") == 200, a.start_timeout, "server /health",
                 alive=p.server)
        if under_agent:
            p.agent, p.url, p.users = setup.agent(p.server_url, f"{name}-agent", sleeps=sleeps, **agent)
            wait_for(lambda: state(p.url) == "SERVING", a.start_timeout, "agent SERVING", interval=0.05,
                     alive=p.agent)
        yield p
    finally:
        if p.agent is not None:
            stop(p.agent)
        stop(p.server)


# -- reading the pieces ------------------------------------------------------------------
def wait_for(cond: Callable[[], bool], timeout: float, what: str, interval: float = 0.01,
             alive: Started | None = None) -> float:
    """Poll until cond(); the monotonic time it held.  Raises with `what` on timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return time.monotonic()
        if alive is not None and alive.exited() is not None:
            raise RuntimeError(f"{what}: the process exited ({alive.last_line()})")
        time.sleep(interval)
    raise RuntimeError(f"{what}: not within {timeout:g} s")


def metric(url: str, name: str, **labels: str) -> float:
    """One sample's value from the agent's /metrics (0 when absent)."""
    with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    total = 0.0
    for m in re.finditer(rf"^{re.escape(name)}(?:\{{([^}}]*)\}})? ([0-9.e+-]+|NaN)$", text, re.M):
        have = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1) or ""))
        if all(have.get(k) == v for k, v in labels.items()) and m.group(2) != "NaN":
            total += float(m.group(2))
    return total


def state(url: str) -> str:
    try:
        return str(get_json(url + "/startupz", timeout=2)["state"])
    except (OSError, ValueError, KeyError):
        return "?"


def sleeping(server_url: str) -> bool:
    try:
        return bool(get_json(server_url + "/props", timeout=2).get("is_sleeping"))
    except (OSError, ValueError):
        return False


def server_wakes(log_path: str) -> int:
    """Wakes llama-server logged (its own words)."""
    with open(log_path, errors="replace") as f:
        return f.read().count("exiting sleeping state")


def warm(base: str, model: str | None, traffic: Traffic, shape: Shape) -> None:
    """STEADY requests of `shape`: what a server has seen before it goes idle."""
    for _ in range(STEADY):
        stream_chat(base, model, traffic.request(shape))


def first_and_steady(base: str, model: str | None, traffic: Traffic, shape: Shape) -> dict[str, Any]:
    """The first request of `shape`, then STEADY more: the first's TTFT over their median."""
    first = stream_chat(base, model, traffic.request(shape))
    later = [stream_chat(base, model, traffic.request(shape)).ttft for _ in range(STEADY)]
    steady = statistics.median(later)
    return {"first_ttft_s": first.ttft, "steady_ttft_s": steady, "tax": first.ttft / steady}


def first_then_settled(p: Pod, model: str | None, traffic: Traffic, shape: Shape,
                       first: Any = None) -> dict[str, Any]:
    """The users' first request through the proxy (or `first`, already sent), the STEADY
    that follow it (the tax above, `tax_following`), then, once the agent's warm-up behind
    the users is done (warmup_behind_users_pending 0), STEADY more: their median is the
    steady TTFT of `tax`.  The warm-up behind the users sends its requests between the
    users' (on 2 CPU cores, batches of 128-token prompts beside a 600-token one), so the 5
    that follow may be slower than a settled server: both are kept."""
    first = first or stream_chat(p.users, model, traffic.request(shape))
    following = statistics.median(stream_chat(p.users, model, traffic.request(shape)).ttft for _ in range(STEADY))
    t0 = time.monotonic()
    wait_for(lambda: metric(p.url, "warmup_behind_users_pending") == 0, 300, "the warm-up behind the users done",
             interval=0.1)
    behind_wait = time.monotonic() - t0
    steady = statistics.median(stream_chat(p.users, model, traffic.request(shape)).ttft for _ in range(STEADY))
    return {"first_ttft_s": first.ttft, "steady_ttft_s": steady, "tax": first.ttft / steady,
            "following_ttft_s": following, "tax_following": first.ttft / following, "behind_wait_s": behind_wait}


def wake_the_agent(url: str, wait: bool = True) -> dict[str, Any]:
    """POST /admin/wake: it answers once the pod is warm (up to 300 s), or at once (wait=False)."""
    req = urllib.request.Request(url + "/admin/wake" + ("" if wait else "?wait=false"), data=b"", method="POST",
                                 headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(req, timeout=330 if wait else 10) as r:
        return dict(json.loads(r.read()), status=r.status)


def post_json(url: str, body: dict[str, Any]) -> Any:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


# -- the parts ---------------------------------------------------------------------------
def restart_and_hang(setup: Setup, traffic: Traffic, runs: int, parts: set[str]) -> dict[str, list]:
    """One server under one agent; each run: a warm control and a restart (alternating
    which goes first), then a hang."""
    a = setup.args
    out: dict[str, list] = {"restart": [], "control": [], "hang": []}
    with pod(setup, "restart", under_agent=True) as p:
        for i in range(runs):
            shape = traffic.shape(i)
            order = ("control", "restart") if i % 2 == 0 else ("restart", "control")
            for what in order:
                if what == "control" and "restart" in parts:
                    time.sleep(a.control_idle)
                    out["control"].append({"run": i, **first_and_steady(p.server_url, setup.client_model, traffic,
                                                                         shape)})
                    print(f"run {i} control: first {out['control'][-1]['tax']:.2f}x steady", flush=True)
                elif what == "restart" and "restart" in parts:
                    out["restart"].append(one_restart(setup, p, traffic, shape, i))
            if "hang" in parts:
                out["hang"].append(one_hang(setup, p, i))
    return out


def one_restart(setup: Setup, p: Pod, traffic: Traffic, shape: Shape, i: int, name: str = "restart",
                learned: bool = False) -> dict[str, Any]:
    """Kill the server, start it again; then the users' first request (learned: through
    the agent's proxy, first_then_settled; else straight to the server)."""
    a = setup.args
    url, url_s = p.url, p.server_url
    primes = metric(url, "warmup_state_transitions_total", **{"from": "PRELOAD", "to": "PRIME"})
    t_kill = time.monotonic()
    kill_now(p.server)
    t_out = wait_for(lambda: get_status(url + "/readyz") != 200, 60, "/readyz out after the kill")
    p.server = setup.server(p.port, f"{name}-server-{i + 1}")
    t_health = wait_for(lambda: get_status(url_s + "/health", timeout=1) == 200, a.start_timeout,
                        "restarted server /health", alive=p.server)
    t_ready = wait_for(lambda: get_status(url + "/readyz") == 200, a.start_timeout, "/readyz back", interval=0.01)
    rewarmed = metric(url, "warmup_state_transitions_total", **{"from": "PRELOAD", "to": "PRIME"}) > primes
    rec = {"run": i, "out_after_kill_s": t_out - t_kill, "ready_after_health_s": t_ready - t_health,
           "rewarmed": rewarmed, **(first_then_settled(p, setup.client_model, traffic, shape) if learned
                                    else first_and_steady(url_s, setup.client_model, traffic, shape))}
    print(f"run {i} {name}: out {rec['out_after_kill_s']:.2f} s after the kill, ready "
          f"{rec['ready_after_health_s']:.2f} s after /health, re-warmed {rewarmed}, first {rec['tax']:.2f}x steady",
          flush=True)
    return rec


def one_hang(setup: Setup, p: Pod, i: int) -> dict[str, Any]:
    a = setup.args
    server, url_s, url = p.server, p.server_url, p.url
    os.kill(server.pid, signal.SIGSTOP)
    t_stop = time.monotonic()
    try:
        t_out = wait_for(lambda: get_status(url + "/readyz") != 200, a.hang_seconds + 30, "/readyz out in the hang")
        time.sleep(max(0.0, a.hang_seconds - (time.monotonic() - t_stop)))
    finally:
        os.kill(server.pid, signal.SIGCONT)
    t_answer = wait_for(lambda: get_status(url_s + "/health", timeout=0.5) == 200, 60, "server answers after SIGCONT")
    t_ready = wait_for(lambda: get_status(url + "/readyz") == 200, 120, "/readyz back after the hang")
    rec = {"run": i, "out_after_stop_s": t_out - t_stop, "back_after_server_s": t_ready - t_answer}
    print(f"run {i} hang: out {rec['out_after_stop_s']:.2f} s after SIGSTOP, SERVING "
          f"{rec['back_after_server_s']:.2f} s after the server answered again", flush=True)
    return rec


def sleep_alone(setup: Setup, traffic: Traffic, shape: Shape, i: int) -> dict[str, Any]:
    a = setup.args
    with pod(setup, f"sleep-alone-{i}", under_agent=False, sleep_idle=a.sleep_idle) as p:
        warm(p.server_url, None, traffic, shape)          # as the agent's run does through its proxy
        share = asleep_share(p.server_url, a.idle_period)
        first = first_and_steady(p.server_url, None, traffic, shape)
    rec = {"run": i, "asleep_share": share, "on_demand": first}
    print(f"run {i} sleep alone: asleep {share:.0%} of {a.idle_period:g} s idle; on demand "
          f"{first['tax']:.2f}x steady", flush=True)
    return rec


def asleep_share(url_s: str, period: float, interval: float = 0.05) -> float:
    """The share of the next `period` seconds the server reports itself asleep."""
    t0 = last = time.monotonic()
    asleep = 0.0
    while (now := time.monotonic()) < t0 + period:
        if sleeping(url_s):
            asleep += now - last
        last = now
        time.sleep(interval)
    return asleep / period


def sleep_agent(setup: Setup, traffic: Traffic, shape: Shape, i: int) -> dict[str, Any]:
    a = setup.args
    with pod(setup, f"sleep-agent-{i}", under_agent=True, sleep_idle=a.sleep_idle, sleeps=True) as p:
        server, url_s, url, users = p.server, p.server_url, p.url, p.users
        warm(users, None, traffic, shape)                 # the same warm requests as alone
        wakes = server_wakes(server.log_path)
        share = asleep_share(url_s, a.idle_period)
        probe_wakes = server_wakes(server.log_path) - wakes
        if not sleeping(url_s):
            wait_for(lambda: sleeping(url_s), a.sleep_idle + 3 * a.watch_interval + 5, "asleep under the agent")
        wait_for(lambda: state(url) == "SLEEPING", 3 * a.watch_interval + 2, "SLEEPING", interval=0.02)
        # wake ahead
        t0 = time.monotonic()
        promised = wake_the_agent(url).get("warm_in_seconds")
        t_serving = wait_for(lambda: state(url) == "SERVING", a.start_timeout, "SERVING after the wake", interval=0.01)
        exported_wake = metric(url, "warmup_wake_duration_seconds")
        ahead = first_and_steady(users, None, traffic, shape)
        # asleep again, then a user's request wakes it
        wait_for(lambda: state(url) == "SLEEPING", a.sleep_idle + 3 * a.watch_interval + 5, "SLEEPING again",
                 interval=0.02)
        before = metric(url, "warmup_wake_first_user_request_seconds")
        on_demand = first_and_steady(users, None, traffic, shape)
        wait_for(lambda: metric(url, "warmup_wake_first_user_request_seconds") != before, 10, "exported first request",
                 interval=0.05)
        exported_first = metric(url, "warmup_wake_first_user_request_seconds")
        rec = {"run": i, "asleep_share": share, "probe_wakes": probe_wakes,
               "wake_ahead": {**ahead, "wake_seconds_outside": t_serving - t0, "wake_seconds_exported": exported_wake,
                              "warm_in_seconds_promised": promised},
               "on_demand": {**on_demand, "first_ttft_exported_s": exported_first},
               "wakes_by_cause": {c: metric(url, "warmup_server_wakes_total", cause=c)
                                  for c in ("ahead", "request", "other")}}
        print(f"run {i} sleep agent: asleep {share:.0%} of {a.idle_period:g} s idle, {probe_wakes} wakes by probes; "
              f"wake ahead {t_serving - t0:.2f} s (exported {exported_wake:.2f} s), first {ahead['tax']:.2f}x steady; "
              f"on demand {on_demand['tax']:.2f}x steady, first {on_demand['first_ttft_s'] * 1000:.1f} ms "
              f"(exported {exported_first * 1000:.1f} ms)", flush=True)
        return rec


def idle_run(setup: Setup, traffic: Traffic, shape: Shape, i: int, under_agent: bool) -> dict[str, Any]:
    a = setup.args
    name = "agent" if under_agent else "alone"
    with pod(setup, f"idle-{name}-{i}", under_agent=under_agent) as p:
        warm(p.server_url, setup.client_model, traffic, shape)
        time.sleep(a.idle_seconds)
        rec = {"run": i, **first_and_steady(p.server_url, setup.client_model, traffic, shape)}
    print(f"run {i} idle {a.idle_seconds:g} s {name}: first {rec['first_ttft_s'] * 1000:.1f} ms, "
          f"{rec['tax']:.2f}x steady", flush=True)
    return rec


# -- learned: the agent learns the users' traffic through its proxy (issue 72) ------------
def learned_shape(setup: Setup, traffic: Traffic, server_url: str, i: int) -> Shape:
    """Run i's shape (its sampling and answer length) with prompts of about
    --learned-prompt-tokens tokens: words per token counted once by the server's own chat
    template and tokenizer (/apply-template, /tokenize: neither runs the model)."""
    a = setup.args
    if setup.learned_words is None:
        rng = random.Random(0)
        text = " ".join(rng.choice(WORDS) for _ in range(200))

        def tokens(content: str) -> int:
            prompt = post_json(server_url + "/apply-template", {"messages": [{"role": "user", "content": content}]})
            return len(post_json(server_url + "/tokenize", {"content": prompt["prompt"]})["tokens"])
        words = max(4, round(a.learned_prompt_tokens * 200 / tokens(text)))

        def mean_tokens(words: int) -> int:    # of requests as sent: their own words, prefix and template
            return round(statistics.mean(tokens(traffic.request(traffic.at_length(traffic.shape(0), words))
                                                ["messages"][-1]["content"]) for _ in range(8)))
        words = max(4, round(words * a.learned_prompt_tokens / mean_tokens(words)))
        setup.learned_words, setup.learned_tokens = words, mean_tokens(words)
        print(f"learned traffic: {setup.learned_words} words a prompt, {setup.learned_tokens} tokens", flush=True)
    shape = traffic.at_length(traffic.shape(i), setup.learned_words)
    if a.usage:     # the client asks for usage: the server's own prompt token count reaches the proxy
        shape.body["stream_options"] = {"include_usage": True}
    return shape


def learn(setup: Setup, p: Pod, traffic: Traffic, shape: Shape) -> dict[str, Any]:
    """--learn-requests requests of `shape` through the proxy, one after the other.  A 503
    (the breaker tripped on a loaded CPU: the first prompts of a new length on each slot)
    waits for SERVING and sends again; counted."""
    a = setup.args
    refused: list[str] = []
    ttfts: list[float] = []
    while len(ttfts) < a.learn_requests:
        try:
            ttfts.append(stream_chat(p.users, setup.client_model, traffic.request(shape)).ttft)
        except RequestFailed as e:
            if e.status != 503 or len(refused) >= 20:
                raise
            refused.append(state(p.url))
            wait_for(lambda: state(p.url) == "SERVING", a.start_timeout, "SERVING again while learning",
                     interval=0.1, alive=p.agent)
    if refused:
        print(f"learning: {len(refused)} request(s) refused ({', '.join(sorted(set(refused)))}), sent again",
              flush=True)
    return {"ttft_s": ttfts, "refused": len(refused), "refused_states": refused,
            "breaker_trips": metric(p.url, "warmup_breaker_trips_total")}


def learned_profile(p: Pod) -> dict[str, Any]:
    """What the agent's learned profile holds, as it exports it, and the prompt lengths its
    latest warm-up sent from it (its log's words)."""
    warmed = None
    if p.agent is not None:
        with open(p.agent.log_path, errors="replace") as f:
            found = re.findall(r"warming what users sent: .*prompt lengths \[([0-9, ]*)\]", f.read())
        warmed = [int(n) for n in found[-1].split(",") if n.strip()] if found else None
    return {"shapes": metric(p.url, "warmup_learned_profile_shapes"),
            "requests": metric(p.url, "warmup_learned_profile_requests"), "warmed_prompt_tokens": warmed}


def until_asleep(setup: Setup, p: Pod) -> None:
    """The server asleep (its /props), and the agent's state SLEEPING."""
    a = setup.args
    wait_for(lambda: sleeping(p.server_url), a.start_timeout, "server asleep", interval=0.05, alive=p.server)
    # a breaker tripped meanwhile (a loaded CPU) reopens after 30 s and half-open probes
    wait_for(lambda: state(p.url) == "SLEEPING", 3 * a.learned_watch + 60, "SLEEPING", interval=0.02)


def wake_ahead(setup: Setup, p: Pod, traffic: Traffic, shape: Shape) -> dict[str, Any]:
    """Asleep, then POST /admin/wake (it answers once warm), then the users' first request."""
    until_asleep(setup, p)
    t0 = time.monotonic()
    answer = wake_the_agent(p.url)
    rec = {"wake_answer": answer, "wake_seconds_outside": time.monotonic() - t0,
           "wake_seconds_exported": metric(p.url, "warmup_wake_duration_seconds"), "profile": learned_profile(p),
           **first_then_settled(p, setup.client_model, traffic, shape)}
    return rec


def wake_ahead_held(setup: Setup, p: Pod, traffic: Traffic, shape: Shape) -> dict[str, Any]:
    """Asleep, then POST /admin/wake?wait=false and at once a user's request through the
    proxy, held until the pod is warm (issue 71).  The client sees hold + TTFT; the hold is
    the agent's warmup_proxy_hold_seconds (outcome served), so TTFT after the release is
    the client's minus the hold, and the proxy's own first-token figure is beside it."""
    until_asleep(setup, p)

    def hist(name: str, **labels: str) -> tuple[float, float]:
        return metric(p.url, name + "_sum", **labels), metric(p.url, name + "_count", **labels)
    h0, n0 = hist("warmup_proxy_hold_seconds", outcome="served")
    f0, m0 = hist("warmup_proxy_first_token_seconds", route="main")
    t0 = time.perf_counter()
    answer = wake_the_agent(p.url, wait=False)
    t_call = time.perf_counter() - t0
    first = stream_chat(p.users, setup.client_model, traffic.request(shape))
    h1, n1 = hist("warmup_proxy_hold_seconds", outcome="served")
    f1, m1 = hist("warmup_proxy_first_token_seconds", route="main")
    rest = first_then_settled(p, setup.client_model, traffic, shape, first=first)
    held = h1 - h0 if n1 > n0 else 0.0
    after = first.ttft - held
    return {"wake_answer": answer, "wake_call_s": t_call, "held_requests": n1 - n0, "held_s": held,
            "client_ttft_s": first.ttft, "ttft_after_release_s": after,
            "proxy_ttft_after_release_s": f1 - f0 if m1 - m0 == 1 else None, "steady_ttft_s": rest["steady_ttft_s"],
            "tax": after / rest["steady_ttft_s"], "client_tax": first.ttft / rest["steady_ttft_s"],
            "following_ttft_s": rest["following_ttft_s"], "tax_following": after / rest["following_ttft_s"],
            "behind_wait_s": rest["behind_wait_s"],
            "wake_seconds_exported": metric(p.url, "warmup_wake_duration_seconds"), "profile": learned_profile(p)}


def learned_run(setup: Setup, traffic: Traffic, i: int) -> dict[str, Any]:
    """One run of the learned part: its own Redis and data dirs.
      1. server + agent (default config, Redis): --learn-requests requests of the users'
         shape through the proxy; --idle-seconds of quiet, the first request (idle); the
         server killed and started again, the first after /readyz (after_restart).
      2. both stopped, both started again with the same data dir, the server sleeping when
         idle: the first after SERVING (new_start); asleep, a wake ahead, the first
         (after_wake); asleep, a wake ahead without waiting and a request at once (held).
      3. a second agent, a new data dir, the same Redis: the first after SERVING (shared).
      4. the default grid: an agent with nothing learned (fresh data dir, no Redis), the
         same traffic sent straight to the server before it sleeps, a wake ahead, the first
         (default_grid_after_wake); first or last, alternating with the run."""
    from tests.helpers.servers import Redis
    a = setup.args
    rec: dict[str, Any] = {"run": i}
    # a device machine may have no redis-server: then no shared tier, and no shared case
    redis = Redis(tempfile.mkdtemp(prefix=f"redis-{i}-", dir=setup.scratch)) if shutil.which("redis-server") else None
    data = tempfile.mkdtemp(prefix=f"learned-{i}-", dir=setup.scratch)
    learned: dict[str, Any] = {"learned": True, "data_dir": data, "redis_url": redis.url if redis else None}
    sleep: dict[str, Any] = {"sleep_idle": a.learned_sleep_idle, "sleeps": True}

    def case(name: str, measure: Callable[[], dict[str, Any]]) -> None:
        """One case's record; a case that fails (a 503, a state never reached) is recorded
        as its error, and the run goes on to the next case."""
        load = os.getloadavg()[0]      # the machine's load as the case began: others' work is noise
        try:
            rec[name] = r = {**measure(), "load1": load}
        except (RequestFailed, RuntimeError, OSError) as e:
            rec[name] = {"error": str(e), "load1": load}
            print(f"run {i} {name}: failed: {e}", flush=True)
            return
        first = r.get("first_ttft_s", r.get("client_ttft_s", 0.0))
        held = f", {r['held_requests']:g} held {r['held_s']:.2f} s, client {r['client_tax']:.2f}x" if "held_s" in r else ""
        print(f"run {i} {name}: first {first * 1000:.1f} ms, {r['tax']:.2f}x steady "
              f"({r['steady_ttft_s'] * 1000:.1f} ms; {r['tax_following']:.2f}x the 5 that follow it){held}",
              flush=True)

    def first(p: Pod, shape: Shape) -> Callable[[], dict[str, Any]]:
        """The users' first request now and its steady, with the profile the agent holds."""
        return lambda: {"profile": learned_profile(p), **first_then_settled(p, setup.client_model, traffic, shape)}

    def default_grid() -> None:
        with pod(setup, f"default-{i}", True, learned=True,
                 data_dir=tempfile.mkdtemp(prefix=f"default-{i}-", dir=setup.scratch), **sleep) as p:
            shape = learned_shape(setup, traffic, p.server_url, i)
            warm(p.server_url, setup.client_model, traffic, shape)   # past the proxy: nothing learned
            case("default_grid_after_wake", lambda: wake_ahead(setup, p, traffic, shape))

    try:
        if i % 2:
            default_grid()
        with pod(setup, f"learned-{i}", True, **learned) as p:
            shape = learned_shape(setup, traffic, p.server_url, i)
            rec["shape"] = {**shape.describe(), "prompt_tokens": setup.learned_tokens}
            rec["learning"] = learn(setup, p, traffic, shape)
            rec["profile_learned"] = learned_profile(p)
            time.sleep(a.idle_seconds)
            case("idle", first(p, shape))
            case("after_restart", lambda: one_restart(setup, p, traffic, shape, i, "learned-restart", learned=True))
        rec["profile_saved"] = bool(glob.glob(os.path.join(data, "traffic", "*", "learned_profile.json")))
        with pod(setup, f"learned-{i}-new", True, **learned, **sleep) as p:
            case("new_start", first(p, shape))
            case("after_wake", lambda: wake_ahead(setup, p, traffic, shape))
            case("held", lambda: wake_ahead_held(setup, p, traffic, shape))
        learned["data_dir"] = tempfile.mkdtemp(prefix=f"shared-{i}-", dir=setup.scratch)
        if redis is None:
            rec["shared"] = {"error": "no redis-server on this machine: no shared tier"}
        else:
            with pod(setup, f"learned-{i}-shared", True, **learned) as p:
                case("shared", first(p, shape))
        if not i % 2:
            default_grid()
    finally:
        if redis is not None:
            redis.stop()
    return rec


# -- the figures ---------------------------------------------------------------------------
def med(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def figures(raw: dict[str, list]) -> dict[str, Any]:
    f: dict[str, Any] = {}
    r, c, h = raw.get("restart", []), raw.get("control", []), raw.get("hang", [])
    if r:
        f["restart_first_ttft_tax_median"] = med([x["tax"] for x in r])
        f["restart_control_first_ttft_tax_median"] = med([x["tax"] for x in c])
        f["restart_over_control"] = ratio(f["restart_first_ttft_tax_median"], f["restart_control_first_ttft_tax_median"])
        f["restart_rewarmed"] = all(x["rewarmed"] for x in r)
        f["restart_out_after_kill_s_max"] = max(x["out_after_kill_s"] for x in r)
        f["restart_ready_after_health_s_median"] = med([x["ready_after_health_s"] for x in r])
    if h:
        f["hang_back_after_server_s_max"] = max(x["back_after_server_s"] for x in h)
        f["hang_out_after_stop_s_max"] = max(x["out_after_stop_s"] for x in h)
    alone, agent = raw.get("sleep_alone", []), raw.get("sleep_agent", [])
    if alone and agent:
        f["sleep_share_alone_median"] = med([x["asleep_share"] for x in alone])
        f["sleep_share_agent_median"] = med([x["asleep_share"] for x in agent])
        f["sleep_share_agent_over_alone"] = ratio(f["sleep_share_agent_median"], f["sleep_share_alone_median"])
        f["probe_wakes"] = sum(x["probe_wakes"] for x in agent)
        f["wake_ahead_first_ttft_tax_median"] = med([x["wake_ahead"]["tax"] for x in agent])
        f["wake_on_demand_first_ttft_tax_median"] = med([x["on_demand"]["tax"] for x in agent])
        f["wake_on_demand_alone_first_ttft_tax_median"] = med([x["on_demand"]["tax"] for x in alone])
        f["wake_on_demand_first_ttft_tax_over_alone"] = ratio(f["wake_on_demand_first_ttft_tax_median"],
                                                              f["wake_on_demand_alone_first_ttft_tax_median"])
        f["wake_duration_exported_over_outside_median"] = med(
            [x["wake_ahead"]["wake_seconds_exported"] / x["wake_ahead"]["wake_seconds_outside"] for x in agent])
        f["wake_first_user_exported_over_outside_median"] = med(
            [x["on_demand"]["first_ttft_exported_s"] / x["on_demand"]["first_ttft_s"] for x in agent])
    ia, ig = raw.get("idle_alone", []), raw.get("idle_agent", [])
    if ia and ig:
        f["idle_first_ttft_alone_s_median"] = med([x["first_ttft_s"] for x in ia])
        f["idle_first_ttft_agent_s_median"] = med([x["first_ttft_s"] for x in ig])
        f["idle_first_ttft_tax_alone_median"] = med([x["tax"] for x in ia])
        f["idle_first_ttft_tax_agent_median"] = med([x["tax"] for x in ig])
        f["idle_first_ttft_agent_over_alone"] = ratio(f["idle_first_ttft_agent_s_median"],
                                                      f["idle_first_ttft_alone_s_median"])
    f.update(learned_figures(raw.get("learned", [])))
    return f


# The learned part's cases and their figures' names (issue 72; held: issue 71).
LEARNED = (("after_restart", "learned_first_ttft_tax_after_restart"),
           ("after_wake", "learned_first_ttft_tax_after_wake"),
           ("new_start", "learned_first_ttft_tax_new_start"),
           ("shared", "learned_first_ttft_tax_shared"),
           ("idle", "idle_first_ttft_tax"),
           ("held", "wake_ahead_held_first_ttft_tax"),
           ("default_grid_after_wake", "default_grid_first_ttft_tax_after_wake"))


def learned_figures(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each case's tax, median and max over the runs; the held request's client view and
    hold beside it; which medians and maxima meet issue 72's target."""
    f: dict[str, Any] = {}
    if not runs:
        return f
    for case, name in LEARNED:
        taxes = [r[case]["tax"] for r in runs if "tax" in r.get(case, {})]
        if taxes:
            f[name], f[name + "_max"] = med(taxes), max(taxes)
            f[name + "_over_following"] = med([r[case]["tax_following"] for r in runs if "tax" in r.get(case, {})])
        if len(taxes) < len(runs):
            f[name + "_failed_runs"] = len(runs) - len(taxes)
    held = [r["held"] for r in runs if "tax" in r.get("held", {})]
    if held:
        f["wake_ahead_held_client_ttft_tax"] = med([h["client_tax"] for h in held])
        f["wake_ahead_held_client_ttft_tax_max"] = max(h["client_tax"] for h in held)
        f["wake_ahead_held_seconds"] = med([h["held_s"] for h in held])
        f["wake_ahead_held_seconds_max"] = max(h["held_s"] for h in held)
        f["wake_ahead_held_requests"] = sum(h["held_requests"] for h in held)
        f["wake_ahead_held_wake_seconds_exported"] = med([h["wake_seconds_exported"] for h in held])
    f["learned_breaker_trips_while_learning"] = sum(r["learning"]["breaker_trips"] for r in runs if "learning" in r)
    f["learned_prompt_tokens"] = next((r["shape"]["prompt_tokens"] for r in runs if "shape" in r), None)
    warmed = sorted({n for r in runs for c in ("after_wake", "held") for n in
                     (r.get(c, {}).get("profile") or {}).get("warmed_prompt_tokens") or ()})
    f["learned_warmed_prompt_tokens"] = warmed or None    # what the agent's wake warm-ups sent, as it logged
    f["learned_profile_saved"] = all(r.get("profile_saved") for r in runs)
    f["load1_median"] = med([r[c]["load1"] for r in runs for c, _ in LEARNED if "load1" in r.get(c, {})])
    f["learned_target_tax"] = TARGET
    f["learned_meets_target"] = {name: {"median": f[name] <= TARGET, "max": f[name + "_max"] <= TARGET}
                                 for _, name in LEARNED if name in f and not name.startswith("default_grid")}
    return f


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--server", choices=("llamacpp", "vllm"), default="llamacpp")
    ap.add_argument("--parts", default="restart,hang,sleep",
                    help="of restart, hang, sleep, idle, learned (default %(default)s)")
    ap.add_argument("--runs", type=int, default=3, help="runs of each part, alternating (default %(default)s)")
    ap.add_argument("--seed", type=int, default=None, help="traffic draw seed (default: a fresh one, written out)")
    ap.add_argument("--watch-interval", type=float, default=None,
                    help="readiness.watch_interval_seconds (default 1; learned: the agent's default, 5)")
    ap.add_argument("--sleep-idle", type=int, default=3, help="llama-server --sleep-idle-seconds")
    ap.add_argument("--idle-period", type=float, default=12.0, help="seconds of the idle period whose sleep share counts")
    ap.add_argument("--hang-seconds", type=float, default=8.0)
    ap.add_argument("--control-idle", type=float, default=5.0, help="seconds the warm control waits before its request")
    ap.add_argument("--idle-seconds", type=float, default=None,
                    help="the idle part's idle time (default 20; 120 on the GPU), the learned part's (default 120)")
    ap.add_argument("--idle-runs", type=int, default=None, help="runs of the idle part (default --runs)")
    ap.add_argument("--learn-requests", type=int, default=24, help="learned: the users' requests it learns from")
    ap.add_argument("--learned-prompt-tokens", type=int, default=600, help="learned: the users' prompt length")
    ap.add_argument("--usage", action="store_true",
                    help="learned: the client asks for usage in its streams (stream_options.include_usage)")
    ap.add_argument("--learned-sleep-idle", type=int, default=8,
                    help="learned: llama-server --sleep-idle-seconds of the wake cases' server")
    ap.add_argument("--max-context", type=int, default=2048, help="tokens a slot holds (llama-server -c: 4 times)")
    ap.add_argument("--max-tokens", type=int, default=16, help="answer length of the drawn traffic")
    ap.add_argument("--model", default=None, help="the model directory (default: the embedded model)")
    ap.add_argument("--llama-server", default=None, help="llama-server binary (default: the test build)")
    ap.add_argument("--gguf", default=None, help="the model's GGUF (default: converted from --model)")
    ap.add_argument("--gpu-layers", type=int, default=None, help="llama-server -ngl (a GPU run)")
    ap.add_argument("--start-timeout", type=float, default=300.0)
    ap.add_argument("--data-dir", default=os.path.expanduser("~/.cache/warmup-agent"))
    ap.add_argument("--logs", default=None)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    parts = set(a.parts.split(","))
    unknown = parts - {"restart", "hang", "sleep", "idle", "learned"}
    if unknown:
        ap.error(f"--parts: unknown {sorted(unknown)}; expected restart, hang, sleep, idle, learned")
    if parts & {"sleep", "learned"} and a.server != "llamacpp":
        ap.error("--parts sleep and learned need --server llamacpp (its --sleep-idle-seconds)")
    a.watch_given = a.watch_interval is not None
    a.watch_interval = a.watch_interval if a.watch_given else 1.0
    a.learned_watch = a.watch_interval if a.watch_given else AGENT_WATCH_INTERVAL
    a.idle_seconds = a.idle_seconds if a.idle_seconds is not None else (120.0 if "learned" in parts else 20.0)
    seed = a.seed if a.seed is not None else random.SystemRandom().randrange(2**31)
    scratch = tempfile.mkdtemp(prefix="server-life-")
    a.logs = a.logs or os.path.join(scratch, "logs")
    os.makedirs(a.logs, exist_ok=True)
    traffic = Traffic(seed, max_context=a.max_context if a.server == "llamacpp" else 240, max_tokens=a.max_tokens)
    setup = Setup(a, scratch, traffic)
    print(f"draw seed {seed}; logs in {a.logs}", flush=True)
    raw: dict[str, list] = {}
    if parts & {"restart", "hang"}:
        raw.update(restart_and_hang(setup, traffic, a.runs, parts))
    if "sleep" in parts:
        raw["sleep_alone"], raw["sleep_agent"] = [], []
        for i in range(a.runs):
            order = (False, True) if i % 2 == 0 else (True, False)
            for under in order:
                if under:
                    raw["sleep_agent"].append(sleep_agent(setup, traffic, traffic.shape(i), i))
                else:
                    raw["sleep_alone"].append(sleep_alone(setup, traffic, traffic.shape(i), i))
    if "idle" in parts:
        raw["idle_alone"], raw["idle_agent"] = [], []
        for i in range(a.idle_runs or a.runs):
            for under in ((False, True) if i % 2 == 0 else (True, False)):
                raw["idle_agent" if under else "idle_alone"].append(
                    idle_run(setup, traffic, traffic.shape(i), i, under))
    if "learned" in parts:
        raw["learned"] = [learned_run(setup, traffic, i) for i in range(a.runs)]
    learned = {"learn_requests": a.learn_requests, "learned_prompt_tokens_asked": a.learned_prompt_tokens,
               "learned_sleep_idle_s": a.learned_sleep_idle,
               "client_include_usage": a.usage, "learned_watch_interval_s": a.learned_watch,
               "max_context": a.max_context} if "learned" in parts else {}
    result = {**provenance(), "bench": "server_life", "server": a.server, "draw_seed": seed, "runs": a.runs,
              "parts": sorted(parts), **learned, "watch_interval_s": a.watch_interval, "sleep_idle_s": a.sleep_idle,
              "idle_period_s": a.idle_period, "hang_s": a.hang_seconds, "idle_s": a.idle_seconds,
              "gpu": gpu_name(), "gpu_layers": a.gpu_layers, **figures(raw),
              "shapes": [traffic.shape(i).describe() for i in range(a.runs)], "raw": raw}
    out = a.out or os.path.join(ROOT, "bench", "results", f"server_life_{a.server}_{time.strftime('%Y-%m-%d')}.json")
    write_result(out, result)
    print(json.dumps({k: v for k, v in result.items() if k not in ("raw", "shapes")}, indent=1, default=str))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
