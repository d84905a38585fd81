"""The digits set the training tests use, split as examples/train_digits.py splits it.

    Xtr, ytr, Xte, yte = digits.split()   # 360 held-out digits, the rest to train on
"""
import numpy as np

import pycyxwiz as cx


def split():
    X, y = cx.datasets.load_digits()
    perm = np.random.default_rng(0).permutation(len(X))
    te, tr = perm[:360], perm[360:]
    return X[tr], y[tr], X[te], y[te]
