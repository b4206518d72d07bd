"""Helpers for the tests (not tests themselves): the repository's paths, the real
servers the tests start (Prometheus, Alertmanager, Redis, the CPU vLLM server) and
TLS certificates.  Import them as `from tests.helpers.servers import Redis`."""
