"""What a run leaves behind and what a person sees of it: the stage timeline
(timeline.py), the run record behind /startupz and --record (record.py), the live
progress display (progress.py), the report of a recorded run (report.py) and the
start-up traces (tracing.py)."""
