"""`specserve bench`: a serving benchmark against any OpenAI-compatible server (vLLM's `bench serve` metrics).

datasets.py builds the requests (random lengths, a JSONL of prompts, ShareGPT conversations); client.py streams
one request and times it; runner.py sends them (Poisson arrivals, a concurrency cap, a progress bar) and reads
the server's speculation statistics; report.py turns the results into the table and the JSON; plots.py draws
them; cli.py is the command line.
"""
