"""One request through the users' own path, just before SERVING.

With the torch engine behind `--proxy-listen`, warmup and probes call the model
directly, so a user's first request would be the first to run everything between the
listener and the model (request handling, chat template, tokenizer, batcher, SSE).
This request, marked `X-Warmup: true`, pays those first-use costs instead.
"""
from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

from warmup_agent.errors import EngineError
from warmup_agent.event_stream import EventStream
from warmup_agent.server.command import http_url, reach_host

#: Two tokens out, so the decode path runs.
BODY = {"messages": [{"role": "user", "content": "Say hello to the first user of this pod."}],
        "max_tokens": 2, "temperature": 0.7, "top_p": 0.9, "stream": True}


def send(host: str, port: int, timeout: float) -> dict:
    """POST BODY to the proxy and read the whole stream; returns its timings.  Raises
    EngineError unless the answer is a 200 event stream ending with [DONE]."""
    url = http_url(reach_host(host), port) + "/v1/chat/completions"
    req = urllib.request.Request(url, data=json.dumps(BODY).encode(), method="POST",
                                 headers={"Content-Type": "application/json", "X-Warmup": "true"})
    t0 = time.perf_counter()
    first = None
    chunks = 0
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            events = EventStream(r, f"the users' path before SERVING: POST {url}")
            for _ in events:
                first = first if first is not None else time.perf_counter() - t0
                chunks += 1
    except urllib.error.HTTPError as e:
        detail = e.read().decode("utf-8", "replace")[:300]
        raise EngineError("request_failed", f"the users' path before SERVING: POST {url}: HTTP {e.code}: {detail}") from None
    except (urllib.error.URLError, OSError) as e:
        raise EngineError("request_failed", f"the users' path before SERVING: POST {url}: {getattr(e, 'reason', e)}") from None
    except ValueError as e:
        raise EngineError("request_failed", f"the users' path before SERVING: POST {url}: not an event stream ({e})") from None
    if not events.done:
        raise EngineError("request_failed", f"the users' path before SERVING: POST {url}: the stream ended without [DONE]")
    return {"seconds": round(time.perf_counter() - t0, 6), "first_byte_seconds": round(first or 0.0, 6),
            "chunks": chunks}
