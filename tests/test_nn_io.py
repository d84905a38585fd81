"""Model files (.cyxmodel): round trips are bit-identical; bad files fail cleanly, naming the file."""
import os

import numpy as np
import pytest

import pycyxwiz as cx

RNG = np.random.default_rng(7)

# Every module kind, each in a small model that can run it.
MODELS = {
    "linear": lambda: [cx.LinearModule(6, 4, seed=1), cx.LinearModule(4, 3, bias=False, init="xavier", seed=2)],
    "relu": lambda: [cx.LinearModule(6, 4, seed=1), cx.ReLUModule()],
    "leaky_relu": lambda: [cx.LinearModule(6, 4, seed=1), cx.LeakyReLUModule(0.3)],
    "sigmoid": lambda: [cx.SigmoidModule()],
    "tanh": lambda: [cx.TanhModule()],
    "gelu": lambda: [cx.GELUModule()],
    "softmax": lambda: [cx.LinearModule(6, 5, seed=1), cx.SoftmaxModule()],
    "dropout": lambda: [cx.DropoutModule(0.3, seed=9), cx.LinearModule(6, 2, seed=1)],
    "batchnorm": lambda: [cx.LinearModule(6, 4, seed=1), cx.BatchNormModule(4, eps=1e-3, momentum=0.2)],
    "sync_batchnorm": lambda: [cx.LinearModule(6, 4, seed=1), cx.SyncBatchNormModule(4, eps=1e-3, momentum=0.2)],
    "flatten": lambda: [cx.FlattenModule(), cx.LinearModule(6, 2, seed=1)],
}


def build(name):
    model = cx.SequentialModel()
    for m in MODELS[name]():
        model.add(m)
    return model


@pytest.mark.parametrize("name", sorted(MODELS))
def test_round_trip_is_bit_identical(name, tmp_path):
    model = build(name)
    x = RNG.standard_normal((5, 6)).astype(np.float32)
    for _ in range(2):  # train-mode passes update BatchNorm running statistics
        model.forward(x)
    model.flat_parameters()[...] += RNG.standard_normal(model.num_parameters()).astype(np.float32) * 0.1
    path = tmp_path / f"{name}.cyxmodel"
    model.save(path)
    loaded = cx.SequentialModel.load(path)
    assert repr(loaded) == repr(model)
    assert loaded.param_slices() == model.param_slices()
    np.testing.assert_array_equal(loaded.flat_parameters(), model.flat_parameters())
    model.eval()
    loaded.eval()
    np.testing.assert_array_equal(loaded.forward(x), model.forward(x))
    if name == "dropout":  # same seed: same masks in training mode
        fresh = build(name)
        fresh.flat_parameters()[...] = model.flat_parameters()
        np.testing.assert_array_equal(cx.SequentialModel.load(path).train().forward(x), fresh.forward(x))


def saved_bytes(tmp_path):
    path = tmp_path / "m.cyxmodel"
    build("batchnorm").save(str(path))
    return path, path.read_bytes()


def test_truncated_file_is_rejected(tmp_path):
    path, data = saved_bytes(tmp_path)
    for cut in (len(data) - 1, len(data) // 2, 30, 20, 5):
        path.write_bytes(data[:cut])
        with pytest.raises(OSError, match=r"m\.cyxmodel'.*truncated"):
            cx.SequentialModel.load(path)


def test_corrupted_file_is_rejected(tmp_path):
    path, data = saved_bytes(tmp_path)
    for pos in (30, len(data) // 2, len(data) - 12):
        bad = bytearray(data)
        bad[pos] ^= 0x40
        path.write_bytes(bytes(bad))
        with pytest.raises(OSError, match=r"m\.cyxmodel'.*corrupted \(checksum mismatch\)"):
            cx.SequentialModel.load(path)


def test_foreign_and_empty_files_are_rejected(tmp_path):
    path = tmp_path / "m.cyxmodel"
    for content in (b"", b"PK\x03\x04 this is a zip file really", np.arange(10).tobytes()):
        path.write_bytes(content)
        with pytest.raises(OSError, match=r"m\.cyxmodel'.*not a pycyxwiz model file"):
            cx.SequentialModel.load(path)


def test_newer_format_version_is_rejected(tmp_path):
    path, data = saved_bytes(tmp_path)
    bad = bytearray(data)
    bad[8] = 9
    path.write_bytes(bytes(bad))
    with pytest.raises(OSError, match="unsupported format version 9"):
        cx.SequentialModel.load(path)


def test_trailing_garbage_is_rejected(tmp_path):
    path, data = saved_bytes(tmp_path)
    path.write_bytes(data + b"xx")
    with pytest.raises(OSError, match="2 unexpected trailing bytes"):
        cx.SequentialModel.load(path)


def test_missing_file_and_directory(tmp_path):
    with pytest.raises(OSError, match="nope.cyxmodel"):
        cx.SequentialModel.load(tmp_path / "nope.cyxmodel")
    with pytest.raises(OSError, match="is a directory"):
        cx.SequentialModel.load(tmp_path)


def test_save_is_atomic_and_leaves_no_temporary_files(tmp_path):
    path = tmp_path / "m.cyxmodel"
    build("linear").save(path)
    first = path.read_bytes()
    build("relu").save(path)  # replaces
    assert path.read_bytes() != first
    assert sorted(os.listdir(tmp_path)) == ["m.cyxmodel"]
    with pytest.raises(OSError, match="no_such_dir"):
        build("linear").save(tmp_path / "no_such_dir" / "m.cyxmodel")
    assert path.read_bytes() != first  # untouched by the failed save


def test_empty_model_round_trips(tmp_path):
    cx.SequentialModel().save(tmp_path / "e.cyxmodel")
    assert len(cx.SequentialModel.load(tmp_path / "e.cyxmodel")) == 0
