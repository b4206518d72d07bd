"""The openai engine: an OpenAI-compatible server, supervised or already running."""
