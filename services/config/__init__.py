"""A frozen, validated config per service role (`roles.py`) and their JSON hand-off."""
