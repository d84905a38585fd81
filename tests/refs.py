"""Independent NumPy references for the collectives' tests.

Each rank's data is a pure function of (rank, n, dtype, op), so every rank and
the test process can rebuild every other rank's contribution and reduce it with
NumPy, without any help from pycyxwiz.
"""
from __future__ import annotations

import numpy as np

REDUCE_DTYPES = ["float32", "float64", "float16", "bfloat16", "int32", "int64", "uint8"]
OPS = ["SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"]
BITWISE = ("BAND", "BOR", "BXOR")
INTEGERS = ("int32", "int64", "uint8")


def bf16_round(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits (uint16), round to nearest even."""
    b = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    b = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    return b.astype(np.uint16)


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def contribution(rank: int, n: int, dtype: str, op: str) -> np.ndarray:
    """Rank's input. Values keep every reduction exact in every dtype: small integers
    for sums, factors of +-1/2/0.5 for products (1 and 2 for integer products)."""
    rng = np.random.default_rng([rank, n, REDUCE_DTYPES.index(dtype), OPS.index(op)])
    if op == "PRODUCT":
        if dtype in ("int32", "int64", "uint8"):
            v = rng.choice([1, 1, 1, 2], size=n)
        else:
            v = rng.choice([1.0, -1.0, 2.0, 0.5], size=n)
    elif dtype == "uint8":
        v = rng.integers(0, 60, size=n)
    else:
        v = rng.integers(-20, 21, size=n)
    if dtype == "bfloat16":
        return bf16_round(v.astype(np.float32))
    return v.astype(dtype)


def expected(world: int, n: int, dtype: str, op: str) -> np.ndarray:
    xs = [contribution(r, n, dtype, op) for r in range(world)]
    if dtype == "bfloat16":
        f = np.stack([bf16_to_f32(x) for x in xs])
        red = {"SUM": f.sum(0), "AVG": f.sum(0) / np.float32(world), "PRODUCT": f.prod(0),
               "MIN": f.min(0), "MAX": f.max(0)}[op]
        return bf16_round(red.astype(np.float32))
    a = np.stack(xs)
    if op == "SUM":
        return a.sum(0, dtype=dtype)
    if op == "AVG":
        if dtype == "float16":  # sums are exact; divide like the library: in float32, round once
            return (a.astype(np.float32).sum(0) / np.float32(world)).astype(np.float16)
        return (a.sum(0, dtype=dtype) / world).astype(dtype)
    if op == "PRODUCT":
        return a.prod(0, dtype=dtype)
    if op == "MIN":
        return a.min(0)
    if op in BITWISE:
        return {"BAND": np.bitwise_and, "BOR": np.bitwise_or, "BXOR": np.bitwise_xor}[op].reduce(a, 0).astype(dtype)
    return a.max(0)


def valid_pair(dtype: str, op: str) -> bool:
    """AVG of integers and the bitwise ops of floats are refused."""
    return not (op == "AVG" and dtype in INTEGERS) and not (op in BITWISE and dtype not in INTEGERS)


def numeric_grad(f, x, eps=1e-6):
    """Central differences of scalar f at x (float64), element by element."""
    g = np.zeros_like(x)
    it = np.nditer(x, flags=["multi_index"])
    for _ in it:
        i = it.multi_index
        old = x[i]
        x[i] = old + eps
        fp = f()
        x[i] = old - eps
        fm = f()
        x[i] = old
        g[i] = (fp - fm) / (2 * eps)
    return g
