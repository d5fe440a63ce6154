"""The router's workers: which exist, their health, and which one gets a request."""
