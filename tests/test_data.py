"""cx.data in DistributedTrainer: a Dataset of the same arrays trains to the same bits (with a validation split,
dropout and a resume), NpyDataset over shards and over a file larger than the memory the rank allows itself,
evaluate(dataset), the prefetch thread, and every misuse's message."""
import os
import resource
import threading

import numpy as np
import pytest

import digits
import ranks

import pycyxwiz as cx

D = cx.distributed


class Arrays(cx.data.Dataset):
    """The arrays (X, y) as a Dataset; records which threads call it and whether two calls ever overlap (fit reads
    each epoch, and each validation, on a thread of its own, one at a time)."""

    def __init__(self, X, y):
        self.X, self.y = X, y
        self.threads = set()
        self.busy = threading.Lock()
        self.overlapped = False

    def __len__(self):
        return len(self.X)

    def __getitem__(self, indices):
        if not self.busy.acquire(blocking=False):
            self.overlapped = True
            self.busy.acquire()
        try:
            self.threads.add(threading.get_ident())
            return self.X[indices], self.y[indices]
        finally:
            self.busy.release()


def mlp(seed=0):
    m = cx.SequentialModel()
    m.add(cx.LinearModule(64, 32, seed=seed))
    m.add(cx.ReLUModule())
    m.add(cx.DropoutModule(0.2, seed=seed + 7))
    m.add(cx.LinearModule(32, 10, seed=seed + 1))
    return m


def config(**kw):
    return D.DistributedTrainingConfig(verbose=False, seed=42, batch_size=24, **kw)


def train(kind, directory="", resume=None, epochs=3):
    """Digits with a validation split, dropout and Adam, from arrays, a Dataset of them or .npy shards."""
    Xtr, ytr, Xte, yte = digits.split()
    model = mlp(seed=2)
    trainer = D.DistributedTrainer(model, cx.CrossEntropyLoss(), cx.AdamOptimizer(3e-3))
    c = config(epochs=epochs, validation_split=0.15, checkpoint_every_n_epochs=1 if directory else 0,
               checkpoint_dir=directory or "./checkpoints", resume_from=resume)
    threads = set()
    if kind == "arrays":
        h = trainer.fit(Xtr, ytr, c)
        test = trainer.evaluate(Xte, yte, batch_size=50)
    else:
        if kind == "dataset":
            ds = Arrays(Xtr, ytr)
        else:
            ds = cx.data.NpyDataset(*kind)
        h = trainer.fit(ds, c)
        test = trainer.evaluate(Arrays(Xte, yte), batch_size=50)
        if isinstance(ds, Arrays):
            threads = ds.threads
            assert not ds.overlapped
    return (model.flat_parameters().copy(), h.train_losses, h.val_losses, h.val_accuracies, test,
            threading.get_ident() in threads, bool(threads))


def test_a_dataset_of_the_same_arrays_trains_to_the_same_bits():
    arrays = ranks.run(train, 2, args=("arrays",))
    dataset = ranks.run(train, 2, args=("dataset",))
    for a, d in zip(arrays, dataset):
        assert np.array_equal(a[0], d[0])
        assert a[1:5] == d[1:5]                       # losses, validation, evaluate: the same numbers
        assert d[5:] == (False, True)                 # read by background threads, never the trainer's


def write_shards(directory, cuts):
    Xtr, ytr, _, _ = digits.split()
    xs, ys = [], []
    for k, (a, b) in enumerate(zip(cuts[:-1], cuts[1:])):
        xs.append(os.path.join(directory, f"x{k}.npy"))
        ys.append(os.path.join(directory, f"y{k}.npy"))
        np.save(xs[-1], Xtr[a:b])
        np.save(ys[-1], ytr[a:b].astype(np.int32))    # int32 labels on disk: widened as fit widens arrays
    return xs, ys


@pytest.mark.parametrize("cuts", [[0, None], [0, 500, 501, 1100, None]], ids=["one file", "four shards"])
def test_npy_files_train_to_the_same_bits_as_the_arrays(tmp_path, cuts):
    # One file of float32 rows: the step gathers from the map (Note [Gathering from a map]); several: the loader.
    n = len(digits.split()[0])
    shards = write_shards(str(tmp_path), [n if c is None else c for c in cuts])
    assert len(cx.data.NpyDataset(*shards)) == n
    assert (cx.data.NpyDataset(*shards)._arrays() is not None) == (len(cuts) == 2)
    arrays = ranks.run(train, 2, args=("arrays",))
    npy = ranks.run(train, 2, args=(shards,))
    for a, d in zip(arrays, npy):
        assert np.array_equal(a[0], d[0]) and a[1:5] == d[1:5]


def test_a_dataset_resumes_from_a_checkpoint_to_the_same_bits_as_arrays(tmp_path):
    whole = ranks.run(train, 2, args=("arrays",))
    ranks.run(train, 2, args=("dataset", str(tmp_path / "a"), None, 2))
    resumed = ranks.run(train, 2, args=("dataset", str(tmp_path / "b"), str(tmp_path / "a" / "epoch_0001.ckpt")))
    for w, r in zip(whole, resumed):
        assert np.array_equal(w[0], r[0]) and w[1:5] == r[1:5]


def test_npy_dataset_reads_rows_across_shards_in_order(tmp_path):
    xs, ys = write_shards(str(tmp_path), [0, 3, 4, 9])
    ds = cx.data.NpyDataset(xs, ys)
    Xtr, ytr, _, _ = digits.split()
    idx = np.array([8, 0, 3, 4, 2, 8], np.int64)
    X, y = ds[idx]
    assert np.array_equal(X, Xtr[idx]) and np.array_equal(y, ytr[idx])
    assert ds.shape == (9, 64) and "3 shards" in repr(ds)
    with pytest.raises(IndexError, match="index 9 is out of range for 9 samples"):
        ds[np.array([1, 9])]
    import pickle
    again = pickle.loads(pickle.dumps(ds))           # the paths travel, not the data
    assert len(pickle.dumps(ds)) < 1000 and np.array_equal(again[idx][0], X)


# ---- a file larger than the memory this rank allows itself ---------------------------------------------

FEATURES, ROWS = 1 << 17, 2048       # 2048 rows of 512 KiB: a 1 GiB file, sparse but for its first rows


def make_big(directory):
    xp, yp = os.path.join(directory, "x.npy"), os.path.join(directory, "y.npy")
    X = np.lib.format.open_memmap(xp, mode="w+", dtype=np.float32, shape=(ROWS, FEATURES))
    rng = np.random.default_rng(0)
    X[:64] = rng.standard_normal((64, FEATURES), dtype=np.float32)
    X.flush()
    del X
    np.save(yp, rng.integers(0, 10, ROWS))
    return xp, yp


def vm_data():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmData:"))


def big_body(xp, yp):
    # RLIMIT_DATA caps this process's heap and private memory (NumPy arrays, malloc, anonymous mappings) at
    # what it has now plus 256 MiB; the read-only mapping of the file is page cache, outside it.
    limit = vm_data() + (256 << 20)
    resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
    try:
        np.load(xp)
        loaded_whole = True
    except MemoryError:
        loaded_whole = False
    model = cx.SequentialModel()
    model.add(cx.LinearModule(FEATURES, 10, seed=1))
    before = model.flat_parameters().copy()
    trainer = D.DistributedTrainer(model, cx.CrossEntropyLoss(), cx.SGDOptimizer(0.01))
    ds = cx.data.NpyDataset(xp, yp)
    h = trainer.fit(ds, D.DistributedTrainingConfig(epochs=1, batch_size=32, verbose=False))
    after = model.flat_parameters()
    return (loaded_whole, limit, h.train_losses, h.total_samples, bool(np.isfinite(after).all()),
            bool((after != before).any()), vm_data() <= limit)


def test_npy_dataset_trains_on_a_file_larger_than_the_memory_the_rank_may_use(tmp_path):
    xp, yp = make_big(str(tmp_path))
    size = os.path.getsize(xp)
    for loaded_whole, limit, losses, samples, finite, changed, within in ranks.run(big_body, 2, args=(xp, yp),
                                                                                     timeout=180):
        assert size > (1 << 30) and size > limit
        assert not loaded_whole                          # the limit is real: the file does not fit under it
        assert len(losses) == 1 and np.isfinite(losses[0]) and samples == ROWS
        assert finite and changed and within


# ---- evaluate(dataset) ----------------------------------------------------------------------------------------

def evaluate_body():
    X, y = cx.datasets.load_digits()
    trainer = D.DistributedTrainer(mlp(seed=4), cx.CrossEntropyLoss(), cx.SGDOptimizer(0.1))
    return trainer.evaluate(X[:301], y[:301], batch_size=37), trainer.evaluate(Arrays(X[:301], y[:301]),
                                                                              batch_size=37)


def test_evaluate_of_a_dataset_is_evaluate_of_its_arrays_on_3_ranks():
    for arrays, dataset in ranks.run(evaluate_body, 3):
        assert arrays == dataset


# ---- misuse ---------------------------------------------------------------------------------------------------

class Bad(cx.data.Dataset):
    def __init__(self, case, failing_rank=None):
        self.case, self.failing_rank = case, failing_rank
        X, y = cx.datasets.load_digits()
        self.X, self.y = X[:200], y[:200]

    def __len__(self):
        return {"negative length": -1, "float length": 200.0}.get(self.case, 200)

    def __getitem__(self, idx):
        X, y = self.X[idx], self.y[idx]
        if self.failing_rank not in (None, D.get_rank()):
            return X, y
        if self.case == "list":
            return [X, y]
        if self.case == "short X":
            return X[:-1], y
        if self.case == "short y":
            return X, y[:-1]
        if self.case == "strings":
            return X.astype(str), y
        if self.case == "complex y":
            return X, y.astype(np.complex64)
        if self.case == "flat X":
            return X[:, 0], y
        if self.case == "raises":
            raise OSError(f"disk gone while reading {len(idx)} rows")
        return X, y


def bad_dataset_body(case, failing_rank=None):
    trainer = D.DistributedTrainer(mlp(), cx.CrossEntropyLoss(), cx.AdamOptimizer(1e-3))
    if case == "evaluate with y":
        trainer.evaluate(Bad("ok"), np.zeros(3))
    elif case == "fit(dataset, array)":
        trainer.fit(Bad("ok"), np.zeros(3), config(epochs=1))
    elif case == "fit(X)":
        trainer.fit(Bad("ok").X)
    elif case == "evaluate(X)":
        trainer.evaluate(Bad("ok").X)
    elif case == "evaluate batch 0":
        trainer.evaluate(Bad("ok"), batch_size=0)
    elif case.startswith("evaluate "):
        trainer.evaluate(Bad(case[len("evaluate "):], failing_rank))
    else:
        trainer.fit(Bad(case, failing_rank), config(epochs=1))


@pytest.mark.parametrize("case, exc, text", [
    ("list", "TypeError", "fit: Bad[indices] must return a tuple (X_batch, y_batch), got list of length 2"),
    ("short X", "ValueError", "fit: Bad[indices] returned 23 rows of X for 24 indices; it must return one row per "
                              "index"),
    ("short y", "ValueError", "fit: Bad[indices] returned y of shape (23,) for 24 indices; y_batch must have one "
                              "entry per index"),
    ("strings", "TypeError", "fit: Bad[indices] returned X of dtype <U"),
    ("complex y", "TypeError", "fit: Bad[indices]: y must hold integer class labels or float targets, got dtype "
                               "complex64"),
    ("flat X", "ValueError", "fit: Bad[indices] returned X of shape (24,); X_batch must have shape (batch, "
                             "features...)"),
    ("negative length", "TypeError", "fit: len(Bad) must be an int >= 0 (__len__() should return >= 0)"),
    ("float length", "TypeError", "fit: len(Bad) must be an int >= 0 ('float' object cannot be interpreted as an "
                                  "integer)"),
    ("raises", "OSError", "disk gone while reading 24 rows"),
    ("evaluate short X", "ValueError", "evaluate: Bad[indices] returned 199 rows of X for 200 indices"),
    ("evaluate with y", "TypeError", "evaluate(dataset) takes no y: the Dataset gives the targets"),
    ("fit(dataset, array)", "TypeError", "fit(dataset, ...) takes (dataset, config) or (dataset, val_dataset, "
                                         "config), with cx.data.Dataset for both; got (Bad, ndarray, ...)"),
    ("fit(X)", "TypeError", "fit() takes (X, y, config), (X, y, X_val, y_val, config) or, for data that does not "
                            "fit in memory, (dataset, config) with a cx.data.Dataset"),
    ("evaluate(X)", "TypeError", "evaluate() takes (X, y) arrays or a cx.data.Dataset"),
    ("evaluate batch 0", "ValueError", "evaluate: batch_size must be an int >= 1, got 0"),
])
def test_a_dataset_that_returns_the_wrong_thing_is_named(case, exc, text):
    (o,) = ranks.spawn(bad_dataset_body, 1, args=(case,))
    assert o.exc_type == exc and text in o.message, (o.exc_type, o.message)


@pytest.mark.parametrize("case", ["raises", "evaluate short X"])
def test_a_dataset_failing_on_one_rank_fails_every_rank(case):
    outs = ranks.spawn(bad_dataset_body, 2, args=(case, 1), timeout=60)
    assert not outs[1].ok and outs[0].is_a("DistributedError"), [(o.exc_type, o.message) for o in outs]
    assert f"rank 1 failed: {outs[1].exc_type}: " in outs[0].message


def test_npy_dataset_refuses_files_that_do_not_match(tmp_path):
    d = str(tmp_path)
    X = np.zeros((10, 4), np.float32)
    for name, arr in [("x.npy", X), ("y.npy", np.zeros(10, np.int64)), ("y9.npy", np.zeros(9, np.int64)),
                      ("x5.npy", np.zeros((10, 5), np.float32)), ("x64.npy", X.astype(np.float64)),
                      ("flat.npy", np.zeros(10, np.float32)), ("str.npy", np.full((10, 4), "a")),
                      ("yf.npy", np.zeros((10, 2), np.float32))]:
        np.save(os.path.join(d, name), arr)
    p = lambda n: os.path.join(d, n)  # noqa: E731
    cases = [
        ((p("x.npy"), p("y9.npy")), ValueError, "shard 0: '" + p("x.npy") + "' holds 10 samples but '" + p("y9.npy")
         + "' holds 9; they must match"),
        (([p("x.npy"), p("x.npy")], [p("y.npy"), p("y9.npy")]), ValueError, "shard 1:"),
        (([p("x.npy"), p("x.npy")], [p("y.npy")]), ValueError, "2 x files but 1 y files; give one y file per x file"),
        (([p("x.npy"), p("x5.npy")], [p("y.npy"), p("y.npy")]), ValueError, "holds float32 rows of shape (5,) but"),
        (([p("x.npy"), p("x64.npy")], [p("y.npy"), p("y.npy")]), ValueError, "holds float64 rows of shape (4,) but"),
        (([p("x.npy"), p("x.npy")], [p("y.npy"), p("yf.npy")]), ValueError, "shards must agree"),
        ((p("flat.npy"), p("y.npy")), ValueError, "holds shape (10,); x files hold (samples, features...)"),
        ((p("str.npy"), p("y.npy")), TypeError, "NpyDataset: '" + p("str.npy") + "' holds dtype <U1; x must be "
                                                "numeric"),
        ((p("missing.npy"), p("y.npy")), OSError, "NpyDataset: cannot open '" + p("missing.npy") + "' as a .npy file"),
        (([], []), ValueError, "NpyDataset: x_path is an empty list"),
        ((3, p("y.npy")), TypeError, "NpyDataset: x_path must be a path to a .npy file or a list of them, got int"),
    ]
    for args, exc, text in cases:
        with pytest.raises(exc) as e:
            cx.data.NpyDataset(*args)
        assert text in str(e.value), (args, str(e.value))


def test_the_base_dataset_says_what_to_define():
    with pytest.raises(NotImplementedError, match=r"Dataset must define __len__"):
        len(cx.data.Dataset())
    with pytest.raises(NotImplementedError, match=r"must define __getitem__\(indices\) -> \(X_batch, y_batch\)"):
        cx.data.Dataset()[np.arange(3)]
