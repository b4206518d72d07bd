"""`warmup-agent cache stats|pull|push|purge`: inspect and manage the kernel cache.

The lead's warmup_agent/cli.py registers it with `add_parser(subparsers)` and
dispatches to `main(args)`.  `python -m warmup_agent.kernel_cache.cli` runs it
alone (same arguments, plus --config).
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from warmup_agent import config as config_mod


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "cache", help="inspect and manage the shared kernel cache",
        description="Inspect and manage the two-tier kernel cache (local directories + Redis).")
    # SUPPRESS: do not overwrite a --config given to the top-level parser.
    p.add_argument("--config", default=argparse.SUPPRESS, help="agent configuration file (YAML)")
    p.add_argument("--data-dir", default=argparse.SUPPRESS, metavar="DIR",
                   help="data_dir of the agent (the local tier is <data_dir>/kernel-cache unless kernel_cache.dir is set)")
    p.add_argument("--namespace", default=None,
                   help="act on this namespace instead of the one computed for this machine (see `cache stats --all`)")
    sub = p.add_subparsers(dest="cache_command", metavar="{stats,pull,push,purge}")
    sub.required = True
    s = sub.add_parser("stats", help="what the local and shared tiers hold")
    s.add_argument("--json", action="store_true", help="print JSON")
    s.add_argument("--all", action="store_true", help="also list every namespace in Redis")
    sub.add_parser("pull", help="restore the local tier from Redis")
    sub.add_parser("push", help="publish the local tier to Redis")
    g = sub.add_parser("purge", help="delete the namespace from Redis and tell every pod to drop its local copies")
    g.add_argument("--all", action="store_true", help="every namespace under kernel_cache.key_prefix")
    p.set_defaults(func=main)
    return p


def main(args: Any) -> int:
    from warmup_agent.kernel_cache.cache import KernelCache
    from warmup_agent.kernel_cache.shared import SharedUnavailable

    try:
        cfg = config_mod.load(getattr(args, "config", None), flags={"data_dir": getattr(args, "data_dir", None)})
    except config_mod.ConfigError as e:
        print(f"warmup-agent cache: {e}", file=sys.stderr)
        return 2
    # The commands below say themselves when the shared tier is off.
    cache = KernelCache.from_config(cfg.kernel_cache, data_dir=cfg.data_dir, model=cfg.model, solidify=cfg.solidify,
                                    namespace=args.namespace, announce_off=False)
    try:
        cmd = args.cache_command
        if cmd == "stats":
            st = cache.stats()
            if args.all:
                try:
                    st["namespaces"] = cache.namespaces()
                except SharedUnavailable:
                    st["namespaces"] = None
            print(json.dumps(st, indent=2, default=str) if args.json else _text(st))
            return 0
        if cmd in ("pull", "push", "purge") and cache.shared is None:
            print(f"warmup-agent cache {cmd}: shared tier off: {cache.off_reason}", file=sys.stderr)
            return 1
        if cmd == "pull":
            counts = cache.restore()
            print(f"pulled into {cache.local.base}: " + ", ".join(f"{k}={v}" for k, v in sorted(counts.items())))
        elif cmd == "push":
            print(f"published {cache.publish()} entries to namespace {cache.namespace}")
        elif cmd == "purge":
            deleted = cache.invalidate(all_namespaces=args.all)
            print(f"purged {'every namespace' if args.all else 'namespace ' + cache.namespace}: {deleted} Redis keys deleted")
        if cache.degraded:
            print(f"warmup-agent cache {cmd}: Redis unavailable; nothing or only part was done", file=sys.stderr)
            return 1
        return 0
    except SharedUnavailable as e:
        print(f"warmup-agent cache {args.cache_command}: Redis unavailable: {e}", file=sys.stderr)
        return 1
    finally:
        cache.close()


def _text(st: dict) -> str:
    loc, sh = st["local"], st["shared"]
    lines = [f"namespace   {st['namespace']}",
             f"local       {loc['dir']}  {loc['bytes']} bytes (bound {loc['max_bytes']})  files: "
             + ", ".join(f"{k}={v}" for k, v in loc["files"].items())]
    if not sh["enabled"]:
        lines.append(f"shared      off: {sh['off_reason']}")
    elif "entries" in sh:
        lines.append(f"shared      {sh['server']}  {sh['bytes']} bytes  entries: "
                     + ", ".join(f"{k}={v}" for k, v in sh["entries"].items()))
    else:
        lines.append(f"shared      {sh['server']}  unavailable")
    for ns in st.get("namespaces") or []:
        comp = ns["components"] or {}
        lines.append(f"  {ns['namespace']}  torch={comp.get('torch')} cuda={comp.get('cuda')} "
                     f"cc={comp.get('compute_capability')} model={str(comp.get('model_config'))[:12]}")
    return "\n".join(lines)


def _standalone(argv: Any = None) -> int:
    parser = argparse.ArgumentParser(prog="warmup-agent")
    parser.add_argument("--config", default=None)
    add_parser(parser.add_subparsers(dest="command", required=True))
    return main(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(_standalone())
