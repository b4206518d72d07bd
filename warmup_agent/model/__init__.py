"""The model on disk: directory checks before any weight is read, and the embedded default model."""
