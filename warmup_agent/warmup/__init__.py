"""What warmup sends and when it stops; driven by stages/prewarm.py."""
