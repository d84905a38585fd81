"""Models that several test files build (from seeds, so every rank builds the same one)."""
import pycyxwiz as cx

IN, HID, OUT = 20, 48, 5  # mlp3's sizes: 3605 parameters, uneven shards on 2 and 3 ranks (test_zero)


def mlp3(seed):
    """Three linear layers (ReLU, Tanh between): test_ddp's and test_zero's model."""
    m = cx.SequentialModel()
    m.add(cx.LinearModule(IN, HID, seed=seed))
    m.add(cx.ReLUModule())
    m.add(cx.LinearModule(HID, HID, seed=seed + 100))
    m.add(cx.TanhModule())
    m.add(cx.LinearModule(HID, OUT, seed=seed + 200))
    return m


def mlp_with_dropout(seed, hidden):
    """The digits' 64 features to 10 classes through one hidden layer with dropout (its own seed)."""
    m = cx.SequentialModel()
    m.add(cx.LinearModule(64, hidden, seed=seed))
    m.add(cx.ReLUModule())
    m.add(cx.DropoutModule(0.3, seed=seed + 7))
    m.add(cx.LinearModule(hidden, 10, seed=seed + 1))
    return m


def digits_with_a_nan_row():
    """The digits (a copy) with a NaN at row 17, column 5, and a small MLP for them (64-16-10, ReLU): the
    non-finite tests' job, on the CPU and on the GPU trainer alike."""
    from pycyxwiz.datasets import load_digits
    X, y = load_digits()
    X = X.copy()
    X[17, 5] = float("nan")
    m = cx.SequentialModel()
    m.add(cx.LinearModule(64, 16, seed=1))
    m.add(cx.ReLUModule())
    m.add(cx.LinearModule(16, 10, seed=2))
    return X, y, m
