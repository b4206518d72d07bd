"""The model server as a child process.  Empty on purpose: the early spawn imports it before the rest."""
