"""The four warmup stages.  Each module has one `run(agent, ctx, detail)`; the
pipeline times it.  `ctx` is the StageContext (stages/context.py) that the stages
share; `detail` is the stage's part of the run record."""
