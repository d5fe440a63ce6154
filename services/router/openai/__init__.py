"""The OpenAI-compatible HTTP API over the router's request flow."""
