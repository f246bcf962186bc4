"""DLPack in and out (numpy >= 1.22 has np.from_dlpack; Debian 12 ships 1.24)."""

import numpy as np
import pytest

import opjit

pytestmark = pytest.mark.skipif(not hasattr(np, "from_dlpack"),
                                reason="numpy %s has no DLPack support" % np.__version__)


class Foreign:
    """Stands in for another framework's tensor: only the DLPack protocol."""

    def __init__(self, arr):
        self._arr = arr

    def __dlpack__(self, stream=None):
        return self._arr.__dlpack__()

    def __dlpack_device__(self):
        return self._arr.__dlpack_device__()


def test_from_dlpack_is_zero_copy():
    a = np.arange(6, dtype=np.float32)
    b = opjit.from_dlpack(Foreign(a))
    assert np.shares_memory(a, b)


def test_dlpack_round_trip_through_an_op(client, examples_registered):
    x = np.linspace(-1, 1, 8, dtype=np.float32).reshape(2, 4)
    y = client.op("leaky_relu")(Foreign(x), alpha=0.5)
    back = np.from_dlpack(Foreign(y))
    assert np.shares_memory(back, y)  # the output view over shared memory, exported as is
    np.testing.assert_allclose(back, np.where(x > 0, x, 0.5 * x))


def test_tensor_exports_dlpack(client, examples_registered):
    t = opjit.tensor(np.array([1.0, -1.0], np.float32))
    out = client.op("leaky_relu")(t)
    assert isinstance(out, opjit.Tensor)
    arr = np.from_dlpack(out)
    assert np.shares_memory(arr, out.numpy())
    np.testing.assert_allclose(arr, [1.0, -0.01])
    assert opjit.tensor(Foreign(np.ones(2, np.float32))).shape == (2,)
