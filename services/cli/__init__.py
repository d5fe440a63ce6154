"""The `pdserve` commands: argv to config objects to a package's entry point."""
