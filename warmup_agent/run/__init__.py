"""What a person sees of a run: its timeline, progress, traces and the report of its record (stages/record.py)."""
