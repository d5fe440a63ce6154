"""The router process: the public gRPC and OpenAI HTTP APIs over its request flow and pool."""
