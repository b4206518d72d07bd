"""The openai engine: an OpenAI-compatible server, supervised or adopted.  The
HTTP client (client.py) <- what the server can do (discovery.py) <- the
supervised server (server.py) <- the engine (engine.py); other clients' requests
as the server's log shows them (server_traffic.py)."""
