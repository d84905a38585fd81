"""Wrong dtypes, shapes and misuse give errors that say what was expected."""
import numpy as np
import pytest

import pycyxwiz as cx


def model_784():
    model = cx.SequentialModel()
    model.add(cx.LinearModule(784, 16))
    model.add(cx.ReLUModule())
    model.add(cx.LinearModule(16, 10))
    return model


def test_wrong_dtype_is_type_error():
    with pytest.raises(TypeError, match=r"expected a float32 NumPy array of shape \(batch, features\), got float64 array of shape \(2, 784\)"):
        model_784().forward(np.zeros((2, 784)))
    with pytest.raises(TypeError, match="got a list"):
        model_784().forward([[0.0] * 784])


def test_wrong_shape_names_layer_and_expected_shape():
    with pytest.raises(ValueError, match=r"layer 0: Linear\(784, 16\) expects input of shape \(batch, 784\), got \(2, 100\)"):
        model_784().forward(np.zeros((2, 100), np.float32))
    with pytest.raises(ValueError, match=r"shape \(batch, features\), got shape \(784,\)"):
        model_784().forward(np.zeros(784, np.float32))


def test_non_contiguous_input_is_value_error():
    x = np.zeros((784, 4), np.float32).T
    with pytest.raises(ValueError, match="C-contiguous"):
        model_784().forward(x)


def test_backward_errors():
    model = model_784()
    with pytest.raises(ValueError, match=r"call forward\(\) first"):
        model.backward(np.zeros((2, 10), np.float32))
    model.forward(np.zeros((2, 784), np.float32))
    with pytest.raises(ValueError, match=r"output's shape \(2, 10\), got \(2, 9\)"):
        model.backward(np.zeros((2, 9), np.float32))
    with pytest.raises(ValueError, match="no modules"):
        cx.SequentialModel().forward(np.zeros((2, 3), np.float32))


def test_cross_entropy_target_errors():
    loss = cx.CrossEntropyLoss()
    logits = np.zeros((3, 4), np.float32)
    with pytest.raises(ValueError, match=r"label 4 at row 1 is out of range \[0, 4\)"):
        loss.forward(logits, np.array([0, 4, 1]))
    with pytest.raises(ValueError, match="expected 3 labels"):
        loss.forward(logits, np.array([0, 1], np.int32))
    with pytest.raises(TypeError, match="int32/int64 labels of shape \\(batch,\\) or float32 one-hot"):
        loss.forward(logits, np.array([0, 1, 2], np.uint8))
    with pytest.raises(ValueError, match=r"target must have the output's shape \(3, 4\), got \(3, 5\)"):
        loss.forward(logits, np.zeros((3, 5), np.float32))
    with pytest.raises(ValueError, match="before forward"):
        cx.MSELoss().backward()


def test_bad_hyper_parameters():
    with pytest.raises(ValueError, match=r"p must be in \[0, 1\)"):
        cx.DropoutModule(1.0)
    with pytest.raises(ValueError, match="init must be 'kaiming' or 'xavier'"):
        cx.LinearModule(2, 2, init="he")
    with pytest.raises(ValueError, match="must be >= 1"):
        cx.LinearModule(0, 2)
    with pytest.raises(ValueError, match="nesterov=True needs momentum > 0"):
        cx.SGDOptimizer(0.1, nesterov=True)
    with pytest.raises(ValueError, match="batch of at least 2"):
        m = cx.SequentialModel()
        m.add(cx.BatchNormModule(3))
        m.forward(np.zeros((1, 3), np.float32))
