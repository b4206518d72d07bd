"""What a run leaves behind and what a person sees of it: timeline, record, progress, report and traces."""
