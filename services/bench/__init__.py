"""`pdserve bench serve`: an open-loop load generator for an OpenAI-compatible HTTP server (so it
drives vLLM too) or pdserve's gRPC API, with `vllm bench serve`'s flag names and definitions
(ARCHITECTURE.md): `dataset.py` the prompts, `arrivals.py` when they are sent, `backends.py`
how one request is sent and timed, `stats.py` the arithmetic, `sweep.py` points and the rate
sweep, `report.py` tables, JSON and plots, `command.py` the command."""
