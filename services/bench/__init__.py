"""`pdserve bench serve`: open-loop load against OpenAI HTTP servers or pdserve's gRPC API."""

# With `vllm bench serve`'s flag names and definitions (so it drives vLLM too; docs/architecture.md,
# "Definitions"): `dataset.py` the prompts, `arrivals.py` when they are sent, `backends.py` how one
# request is sent and timed, `stats.py` the arithmetic, `sweep.py` points and the rate sweep,
# `report.py` tables, JSON and plots, `command.py` the command.
