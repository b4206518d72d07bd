"""`warmup-agent bench`: an operator measures their own server's cold start as
users meet it -- alone, with one warm-up request, and under the agent.

traffic.py draws the requests, client.py sends them, process.py starts and
stops a server, start.py measures one start, conditions.py runs the starts,
summary.py makes the figures and the JSON, report.py the table, HTML and PNG,
cli.py the command line.
"""
