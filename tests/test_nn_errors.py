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


def test_inputs_follow_one_rule_any_real_dtype_is_converted_like_fit_does():
    """Note [One rule for input arrays]: forward, like fit, takes float64 (NumPy's default), integers, lists and
    non-contiguous views, converted to float32 as np.ascontiguousarray(x, dtype=np.float32) would."""
    model = model_784()
    x = np.random.default_rng(0).standard_normal((3, 784))
    want = model.forward(np.ascontiguousarray(x, dtype=np.float32))
    assert np.array_equal(model.forward(x), want)                     # float64
    assert np.array_equal(model.forward(x.tolist()), want)            # a list
    assert np.array_equal(model.forward(np.asfortranarray(x)), want)  # not C-contiguous
    xi = np.arange(784 * 2).reshape(2, 784) % 7
    assert np.array_equal(model.forward(xi), model.forward(xi.astype(np.float32)))
    model.backward(np.ones((2, 10)))  # float64 grad_output
    loss = cx.MSELoss()
    assert loss.forward(np.zeros((2, 3)), np.ones((2, 3))) == pytest.approx(1.0)


def test_inputs_that_are_not_real_numbers_are_type_errors_in_forward_and_fit():
    with pytest.raises(TypeError, match=r"SequentialModel.forward: expected an array of real numbers of shape "
                                        r"\(batch, features\) \(it is converted to float32\), got complex128 array "
                                        r"of shape \(2, 784\)"):
        model_784().forward(np.zeros((2, 784), np.complex128))
    with pytest.raises(TypeError, match=r"got <U1 array of shape \(2, 1\) \(from a list\)"):
        model_784().forward([["a"], ["b"]])
    from pycyxwiz.distributed._train import _as_inputs
    with pytest.raises(TypeError, match=r"fit: expected an array of real numbers of shape \(samples, features\) "
                                        r"\(it is converted to float32\), got complex128"):
        _as_inputs(np.zeros((2, 3), np.complex128), "fit")
    assert _as_inputs(np.zeros((2, 3)), "fit").dtype == np.float32


def test_wrong_shape_names_layer_and_expected_shape():
    with pytest.raises(ValueError, match=r"layer 0: Linear\(784, 16\) expects input of shape \(batch, 784\), got \(2, 100\)"):
        model_784().forward(np.zeros((2, 100), np.float32))
    with pytest.raises(ValueError, match=r"shape \(batch, features\), got shape \(784,\)"):
        model_784().forward(np.zeros(784, np.float32))


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
