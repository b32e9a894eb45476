"""The command line: parses argv, builds settings, hands each component its section. Nothing imports it."""
