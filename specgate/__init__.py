"""The `specgate` command line (`cli.py`), above every other package."""
