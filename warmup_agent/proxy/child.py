"""`python -m warmup_agent.proxy.child SETTINGS`: the proxy process that process.ProxyProcess
starts (SETTINGS: JSON, with the inherited listening socket's and pipes' descriptors)."""
import json
import sys

from warmup_agent.proxy.process import child_main

if __name__ == "__main__":
    sys.exit(child_main(json.loads(sys.argv[1])))
