"""Model files (.cyxmodel): round trips are bit-identical; bad files fail cleanly, naming the file."""
import base64
import os
import struct

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


# ---- files written before the layer registry (nn/registry.h) still read, and are written alike ----------

# Every layer the first release had, saved by it (commit e68e7d0) from every_layer_model() below.
EVERY_LAYER_V1 = base64.b64decode(
    "Q1lYTU9ERUwBAAAAAAAAAIgDAAAAAAAADAAAAAoAAAAAAAAAAAABAAYAAAAAAAAACAAAAAAAAAABAAIAAAAwAAAAAAAAAAAAgL+O"
    "snu/HGV3v6oXc784ym6/xnxqv1QvZr/i4WG/cJRdv/5GWb+M+VS/GqxQv6heTL82EUi/xMNDv1J2P7/gKDu/bts2v/yNMr+KQC6/"
    "GPMpv6alJb80WCG/wgodv1C9GL/ebxS/bCIQv/rUC7+Ihwe/FjoDv0fZ/b5jPvW+f6PsvpsI5L63bdu+09LSvu83yr4LncG+JwK5"
    "vkNnsL5fzKe+ezGfvpeWlr6z+42+z2CFvtWLeb4NVmi+RSBXvggAAAAAAAAAfepFvrW0NL7tfiO+JUkSvl0TAb4pu9+9mU+9vQnk"
    "mr0AAAAAAgAAAAAAAAAAAAMAmpmZPgAAAAAAAAAACQAIAAAAAAAAAG8SgzrNzEw+AgAAAAgAAAAAAAAA8fBwvdEZLL1hhc68Qa4J"
    "vEGuCTxhhc480RksPfHwcD0IAAAAAAAAAAnkmj2ZT709KbvfPV0TAT4lSRI+7X4jPrW0ND596kU+AgAAAAgAAAAAAAAAAQEPP4fu"
    "/z4N2+E+kcfDPhW0pT6ZoIc+OxpTPkTzFj4IAAAAAAAAAMlQiUCUGmZACIU+QOrgG0B6XPw/ANrKP2k6oz+xfYU/BAAAAAAAAAAA"
    "AAUAAAAAAAAAAAAGAAAAAAAAAAAACAAAAIA+BQAAAAAAAAAAAAAAAAAAAAsACAAAAAAAAACsxSc3AAAAPwIAAAAIAAAAAAAAAEUg"
    "Vz4NVmg+1Yt5Ps9ghT6z+40+l5aWPnsxnz5fzKc+CAAAAAAAAABDZ7A+JwK5PgudwT7vN8o+09LSPrdt2z6bCOQ+f6PsPgIAAAAI"
    "AAAAAAAAABfuMD6BS2A+C0gIPigDtz3nxQk+gstnPnCRDT7rNQ8+CAAAAAAAAAC5zAQ/ewMAP+aOBz+Dqgc/QrkHPzcBAD/AKQg/"
    "blwIPwEACAAAAAAAAAAEAAAAAAAAAAABAQAAACAAAAAAAAAAYz71PkfZ/T4WOgM/iIcHP/rUCz9sIhA/3m8UP1C9GD/CCh0/NFgh"
    "P6alJT8Y8yk/ikAuP/yNMj9u2zY/4Cg7P1J2Pz/Ew0M/NhFIP6heTD8arFA/jPlUP/5GWT9wlF0/4uFhP1QvZj/GfGo/OMpuP6oX"
    "cz8cZXc/jrJ7PwAAgD8AAAAABwAAAAAAAAAAAIyGU0Klniva"
)


def every_layer_model():
    m = cx.SequentialModel()
    for mod in [cx.FlattenModule(), cx.LinearModule(6, 8, seed=1), cx.ReLUModule(), cx.LeakyReLUModule(0.3),
                cx.BatchNormModule(8, eps=1e-3, momentum=0.2), cx.SigmoidModule(), cx.TanhModule(), cx.GELUModule(),
                cx.DropoutModule(0.25, seed=5), cx.SyncBatchNormModule(8, momentum=0.5),
                cx.LinearModule(8, 4, bias=False, init="xavier", seed=2), cx.SoftmaxModule()]:
        m.add(mod)
    m.flat_parameters()[...] = np.linspace(-1, 1, m.num_parameters(), dtype=np.float32)
    m.forward(np.linspace(-2, 2, 5 * 6, dtype=np.float32).reshape(5, 2, 3))  # BatchNorm running statistics move
    return m


def test_a_file_from_before_the_layer_registry_loads_and_is_written_byte_for_byte_alike(tmp_path):
    old = tmp_path / "old.cyxmodel"
    old.write_bytes(EVERY_LAYER_V1)
    loaded = cx.SequentialModel.load(old)
    model = every_layer_model()
    assert repr(loaded) == repr(model)
    np.testing.assert_array_equal(loaded.flat_parameters(), model.flat_parameters())
    # The running statistics are those of a forward pass through Sigmoid, Tanh and GELU, which this build
    # computes within a few ulp of the build that wrote the file (Note [Vector exp] in csrc/nn/kernels.cpp).
    for a, b in zip(loaded, model):
        if isinstance(b, cx.BatchNormModule):
            np.testing.assert_allclose(a.running_mean, b.running_mean, rtol=1e-6)
            np.testing.assert_allclose(a.running_var, b.running_var, rtol=1e-6)
    x = RNG.standard_normal((3, 2, 3)).astype(np.float32)
    np.testing.assert_allclose(loaded.eval().forward(x), model.eval().forward(x), rtol=1e-6)
    new = tmp_path / "new.cyxmodel"
    loaded.save(new)
    assert new.read_bytes() == EVERY_LAYER_V1


def test_every_layer_has_its_own_file_id_and_the_first_ones_keep_theirs():
    ids = cx._core._layer_ids()
    assert len(set(ids.values())) == len(ids)
    first = {1: "Linear", 2: "ReLU", 3: "LeakyReLU", 4: "Sigmoid", 5: "Tanh", 6: "GELU", 7: "Softmax", 8: "Dropout",
             9: "BatchNorm", 10: "Flatten", 11: "SyncBatchNorm"}
    assert {i: ids[i] for i in first} == first
    # every exported layer class is registered under its name (what saving it needs)
    layers = [getattr(cx, n) for n in cx.__all__ if n.endswith("Module") and n != "Module"]
    assert sorted(c.__name__[:-len("Module")] for c in layers) == sorted(ids.values())


def resealed(data):
    """A model file's bytes with the checksum recomputed over its (edited) header and payload: FNV-1a 64."""
    body = data[:-8]
    h = 0xCBF29CE484222325
    for byte in body:
        h = ((h ^ byte) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return body + struct.pack("<Q", h)


def test_an_unknown_layer_id_is_refused_naming_it(tmp_path):
    data = bytearray(EVERY_LAYER_V1)
    # the payload starts at 24: u32 module count, then the first module's u16 id (Flatten, 10)
    assert data[28:30] == bytes([10, 0])
    data[28:30] = (999).to_bytes(2, "little")
    path = tmp_path / "m.cyxmodel"
    path.write_bytes(resealed(bytes(data)))
    with pytest.raises(OSError, match=r"m\.cyxmodel'.*unknown module kind 999 \(written by a newer pycyxwiz\?\)"):
        cx.SequentialModel.load(path)


# ---- image models: nested ResidualModules round trip; bad files are refused as before ----------------

def image_model():
    def seq(*mods):
        m = cx.SequentialModel()
        for mod in mods:
            m.add(mod)
        return m

    inner = seq(cx.Conv2dModule(4, 4, 3, padding=1, bias=False, seed=3), cx.BatchNorm2dModule(4), cx.ReLUModule())
    block = seq(cx.Conv2dModule(2, 4, 3, stride=2, padding=1, seed=1), cx.BatchNorm2dModule(4, eps=1e-3, momentum=0.2),
                cx.ReLUModule(), cx.ResidualModule(inner))
    shortcut = seq(cx.Conv2dModule(2, 4, 1, stride=2, bias=False, seed=2), cx.BatchNorm2dModule(4))
    return seq(cx.Conv2dModule(1, 2, 3, padding=2, dilation=2, seed=0), cx.BatchNorm2dModule(2),
               cx.MaxPool2dModule(3, 1), cx.AvgPool2dModule(2, 1), cx.ResidualModule(block, shortcut), cx.ReLUModule(),
               cx.Conv2dModule(4, 4, 3, padding=1, groups=2, seed=4), cx.GlobalAvgPool2dModule(),
               cx.LinearModule(4, 3, seed=5))


def test_nested_residual_model_round_trips_bit_identically(tmp_path):
    model = image_model()
    x = RNG.standard_normal((4, 1, 9, 9)).astype(np.float32)
    for _ in range(2):  # train-mode passes move every BatchNorm2d's running statistics, the nested ones too
        model.forward(x)
    model.flat_parameters()[...] += RNG.standard_normal(model.num_parameters()).astype(np.float32) * 0.1
    path = tmp_path / "resnet.cyxmodel"
    model.save(path)
    loaded = cx.SequentialModel.load(path)
    assert repr(loaded) == repr(model)
    assert "Residual([Conv2d(2, 4, kernel_size=3, stride=2, padding=1), BatchNorm2d(4, eps=0.001, momentum=0.2), " \
           "ReLU(), Residual([Conv2d(4, 4, kernel_size=3, padding=1, bias=False)" in repr(model)
    assert loaded.param_slices() == model.param_slices()
    np.testing.assert_array_equal(loaded.flat_parameters(), model.flat_parameters())
    nested = [(loaded[4].block[3].block[1], model[4].block[3].block[1]), (loaded[4].shortcut[1], model[4].shortcut[1]),
              (loaded[1], model[1])]
    for a, b in nested:
        assert np.any(b.running_mean != 0)
        np.testing.assert_array_equal(a.running_mean, b.running_mean)
        np.testing.assert_array_equal(a.running_var, b.running_var)
    np.testing.assert_array_equal(loaded.forward(x), model.forward(x))  # train mode: batch statistics
    model.eval()
    loaded.eval()
    np.testing.assert_array_equal(loaded.forward(x), model.forward(x))
    # the loaded model's modules share its flat buffers, as built ones do
    loaded[4].block[3].block[0].weight[...] = 0
    assert not loaded.parameters()[8].any()


def test_damaged_image_model_files_are_refused(tmp_path):
    path = tmp_path / "m.cyxmodel"
    image_model().save(path)
    data = path.read_bytes()
    for cut in (len(data) - 1, len(data) // 2, 40):
        path.write_bytes(data[:cut])
        with pytest.raises(OSError, match=r"m\.cyxmodel'.*truncated"):
            cx.SequentialModel.load(path)
    for pos in (40, len(data) // 3, len(data) - 20):
        bad = bytearray(data)
        bad[pos] ^= 0x08
        path.write_bytes(bytes(bad))
        with pytest.raises(OSError, match=r"corrupted \(checksum mismatch\)"):
            cx.SequentialModel.load(path)


def model_file(payload):
    header = b"CYXMODEL" + struct.pack("<IIQ", 1, 0, len(payload))
    return resealed(header + payload + bytes(8))


def test_a_malicious_nesting_of_residuals_is_refused(tmp_path):
    residual_id = next(i for i, n in cx._core._layer_ids().items() if n == "Residual")
    path = tmp_path / "deep.cyxmodel"
    # 100 Residuals, each block's first layer the next: refused at depth 64, before anything is built
    path.write_bytes(model_file(struct.pack("<I", 1) + struct.pack("<HI", residual_id, 1) * 100 + bytes(64)))
    with pytest.raises(OSError, match=r"deep\.cyxmodel'.*modules nested more than 64 deep"):
        cx.SequentialModel.load(path)
    # an unknown layer inside a block is named like one outside
    path.write_bytes(model_file(struct.pack("<IHIH", 1, residual_id, 1, 4242) + bytes(64)))
    with pytest.raises(OSError, match="unknown module kind 4242"):
        cx.SequentialModel.load(path)
    # bad hyper-parameters of a layer inside a block: the constructor's reason
    conv_id = next(i for i, n in cx._core._layer_ids().items() if n == "Conv2d")
    conv = struct.pack("<H7QB", conv_id, 3, 4, 0, 1, 0, 1, 1, 1)  # kernel_size 0
    path.write_bytes(model_file(struct.pack("<IHI", 1, residual_id, 1) + conv + bytes(64)))
    with pytest.raises(OSError, match="bad module hyper-parameters: Conv2dModule: kernel_size must be >= 1, got 0"):
        cx.SequentialModel.load(path)
