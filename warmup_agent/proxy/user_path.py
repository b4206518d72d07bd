"""One request through the users' own path, just before SERVING (issue 41).

With the torch engine behind `--proxy-listen`, the agent's warmup and probes call the
model directly, so a user's first request was the first to run everything between the
listener and the model: aiohttp's request handling, the JSON body, the chat template,
the tokenizer on text, the batcher's job and its thread hand-over, detokenizing and the
SSE chunks.  The ready stage sends this one request through the proxy's own listener,
marked `X-Warmup: true` (routed to the main engine before SERVING, and kept out of the
users' counters, window and water level), so that those first-use costs are paid here.
"""
from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

from warmup_agent.errors import EngineError
from warmup_agent.event_stream import EventStream
from warmup_agent.server.command import http_url, reach_host

#: A short chat turn, sampled as most chat traffic is, two tokens out: the decode path runs.
BODY = {"messages": [{"role": "user", "content": "Say hello to the first user of this pod."}],
        "max_tokens": 2, "temperature": 0.7, "top_p": 0.9, "stream": True}


def send(host: str, port: int, timeout: float) -> dict:
    """POST BODY to the proxy at host:port; read the whole stream.  Returns what it took
    ({"seconds", "first_byte_seconds", "chunks"}); raises EngineError("request_failed")
    when the answer is not a 200 stream of JSON chunks that ends with [DONE] (an error
    event in the stream fails it, as it fails a warmup request).  An answer without text
    passes: a model may well end its turn at once."""
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
