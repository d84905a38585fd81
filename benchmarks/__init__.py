"""pycyxwiz benchmarks: side by side with PyTorch gloo and Open MPI.

    python -m benchmarks                 # the whole suite, < 15 min, writes benchmarks/results/
    python -m benchmarks.allreduce       # one collective; --help for flags

Not part of the test suite: nothing here asserts a timing.
"""
