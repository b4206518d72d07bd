"""The four warmup stages, each one `run(ctx, detail)` timed by the pipeline over the
StageContext (stages/context.py): the collaborators, the run services and the outputs the
stages share; a stage sees nothing of the Agent.  `detail` is the stage's part of the run
record (record.py).  profile_warmup.py is the loop prewarm drives before and after SERVING."""
