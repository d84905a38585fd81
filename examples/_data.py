"""Data for the examples: scikit-learn's handwritten digits, offline.

Uses the copy embedded in pycyxwiz (pycyxwiz.datasets.load_digits) when the package has
it, else scikit-learn's. Returns X float32 (1797, 64) in [0, 1] and y int64 labels 0..9.
"""
import numpy as np


def load_digits():
    try:
        from pycyxwiz.datasets import load_digits as _load
        return _load()
    except ImportError:
        from sklearn.datasets import load_digits as _load
        d = _load()
        return (d.data / 16.0).astype(np.float32), d.target.astype(np.int64)


def train_test_split(X, y, test_fraction=0.2, seed=0):
    """The same split on every rank (a seeded permutation)."""
    perm = np.random.default_rng(seed).permutation(len(X))
    n_test = int(len(X) * test_fraction)
    te, tr = perm[:n_test], perm[n_test:]
    return X[tr], y[tr], X[te], y[te]
