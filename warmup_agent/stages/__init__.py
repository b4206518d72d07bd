"""The four warmup stages.  Each module has one `run(ctx, detail)`; the
pipeline times it.  `ctx` is the StageContext (stages/context.py): the
collaborators, the run services and the outputs the stages share; a stage sees
nothing of the Agent.  `detail` is the stage's part of the run record."""
