"""``python -m bench``: the side-by-side measurement suite (bench/suite.py)."""
from bench.suite import main

main()
