"""Whether the engine is ready for users, and stays so: the probe log and the
first-request figures (probes.py, cold_decode.py), the window of time-to-first-token
samples (window.py), the thresholds, the breaker and the water level, validation
before SERVING, and runtime.Readiness, which owns them after SERVING."""
