"""`python -m verispec.server [flags]` is `verispec serve [flags]`."""
import sys

from verispec.cli import main

if __name__ == "__main__":
    sys.exit(main(["serve", *sys.argv[1:]]))
