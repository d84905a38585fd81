"""`python -m benchmarks`: the whole suite (see benchmarks/run_all.py)."""
import sys

from benchmarks.run_all import main

sys.exit(main())
