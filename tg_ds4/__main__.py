"""`python -m tg_ds4 <command>`: the command line (cli.py)."""
import sys

from tg_ds4.cli import main

if __name__ == "__main__": sys.exit(main())
