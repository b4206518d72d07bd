"""The torch engine: the model in this process.  Empty so that importing it imports no torch."""
