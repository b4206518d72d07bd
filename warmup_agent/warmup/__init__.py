"""What warmup sends and when it stops: the traffic profile (traffic.py) and the
requests file it can come from (requests_file.py), warming by measured benefit
(benefit.py) and the torch/vllm shape grid over it (shapes.py), and the warmup
grid's memory back-off (memory_budget.py).  Driven by stages/prewarm.py."""
