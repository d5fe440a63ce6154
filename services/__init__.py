"""pdserve's runtime code, one package per concept; env.py and flags.py are its foundations."""
