"""`python -m cbcore ...`: see `cbcore.cli`."""

from cbcore.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
