"""The worker-process runtime prefill/ and decode/ wrap: engine thread, admin, drain, CPU pins."""
