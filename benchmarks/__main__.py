"""Entry point: ``python -m benchmarks [--quick] [--device DEV] [--only ITEM ...]``."""

from benchmarks.suite import main

if __name__ == "__main__":
    main()
