"""The model on disk: checks of a Hugging Face-layout directory before any weight
is read (directory.py) and the embedded default model (embedded.py)."""
