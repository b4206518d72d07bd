"""The openai engine: an OpenAI-compatible server, supervised or adopted.  The
engine (engine.py) composes a server handle (server.py: the supervised or
already-running server), an HTTP client (client.py: streamed requests) and
discovery (discovery.py: what the server answers); other clients' requests as the
server's log shows them (server_traffic.py)."""
