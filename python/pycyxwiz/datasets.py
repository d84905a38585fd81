"""Small data sets bundled with pycyxwiz, so the examples run offline without extra packages.

    from pycyxwiz.datasets import load_digits
    X, y = load_digits()     # X float32 (1797, 64) in [0, 1], y int64 in 0..9
    model.forward(X[:64])

``load_digits`` is the UCI "Optical Recognition of Handwritten Digits" test set (E. Alpaydin,
C. Kaynak, 1998; https://archive.ics.uci.edu/dataset/80) as distributed with scikit-learn
(``sklearn.datasets.load_digits``, BSD-3-Clause): 1797 8x8 images, pixel values 0..16. The
file data/digits.npz was generated once from scikit-learn and stores the pixels as uint8.
"""
from __future__ import annotations

import os
from typing import Tuple

import numpy as np

_DATA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")

__all__ = ["load_digits"]


def load_digits() -> Tuple[np.ndarray, np.ndarray]:
    """Returns (X, y): X float32 of shape (1797, 64) scaled to [0, 1], y int64 of shape (1797,).

        X, y = load_digits()
        assert X.shape == (1797, 64) and y.max() == 9
    """
    with np.load(os.path.join(_DATA_DIR, "digits.npz")) as f:
        images = f["images"]
        labels = f["labels"]
    X = np.ascontiguousarray(images, dtype=np.float32) / np.float32(16.0)
    return X, labels.astype(np.int64)
