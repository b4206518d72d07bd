"""The model server as a child process: the command line (command.py), one Popen
(process.py), the spawn before the agent's own imports (early_spawn.py), the
supervisor that restarts it (supervisor.py), when a process started (procstart.py)
and PID 1's duties (reaper.py).  Empty on purpose: the early spawn imports this
package before the rest of the agent."""
