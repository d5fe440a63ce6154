"""One frozen, validated config per service role and their JSON hand-off to child processes."""
