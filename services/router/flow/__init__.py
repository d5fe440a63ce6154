"""One request's flow through the prefill and decode pools, from prompt to streamed text."""
