"""The CLI's verbs, by family; `workers/cli.py` parses the command line and dispatches to them."""
