"""The Paddle PyLayer examples of ../shared/seeds/002 run as written (issue 29).

Each script below is the seed's text; only the import lines differ
(`import opjit as paddle`, `from opjit.autograd import PyLayer`). They run
with opjit's client-side math (paddle.tanh, paddle.square, paddle.randn and
the Tensor arithmetic: x1+x2, dy * (1 - ...), z.mean().backward()) and, for
the first one, with the daemon's tanh and square kernels as paddle.tanh and
paddle.square. Their printed numbers are checked: paddle.randn's draws
cannot be reproduced, so the first script is also run on the input that
gives the seed's printed gradient, and prints the seed's numbers.
"""

import contextlib
import io
import types

import numpy as np
import pytest

import opjit

IMPORTS = "import opjit as paddle\nfrom opjit.autograd import PyLayer\n"

# 1. cus_tanh: save_for_backward, apply, z.mean().backward(), print(data.grad).
SCRIPT_TANH = IMPORTS + '''
# 通过创建`PyLayer`子类的方式实现动态图Python Op
class cus_tanh(PyLayer):
    @staticmethod
    def forward(ctx, x):
        y = paddle.tanh(x)
        # ctx 为PyLayerContext对象,可以把y从forward传递到backward。
        ctx.save_for_backward(y)
        return y

    @staticmethod
    # 因为forward只有一个输出,因此除了ctx外,backward只有一个输入。
    def backward(ctx, dy):
        # ctx 为PyLayerContext对象,saved_tensor获取在forward时暂存的y。
        y, = ctx.saved_tensor()
        # 调用Paddle API自定义反向计算
        grad = dy * (1 - paddle.square(y))
        # forward只有一个Tensor输入,因此,backward只有一个输出。
        return grad

data = paddle.randn([2, 3], dtype="float32")
data.stop_gradient = False
# 通过 apply运行这个Python算子
z = cus_tanh.apply(data)
z.mean().backward()

print(data.grad)
'''

# What the seed printed for data.grad.
SEED_GRAD = np.array([[0.15810412, 0.16457692, 0.15256986],
                      [0.16439323, 0.10458803, 0.16661729]], np.float32)

# 2. Non-tensor state on ctx (ctx.func), keyword arguments to apply, float64.
SCRIPT_CTX_ATTR = IMPORTS + '''import numpy as np

class tanh(PyLayer):
    @staticmethod
    def forward(ctx, x1, func1, func2=paddle.square):
        # 添加临时属性的方式传递func2
        ctx.func = func2
        y1 = func1(x1)
        # 使用save_for_backward传递y1
        ctx.save_for_backward(y1)
        return y1

    @staticmethod
    def backward(ctx, dy1):
        y1, = ctx.saved_tensor()
        # 获取func2
        re1 = dy1 * (1 - ctx.func(y1))
        return re1

input1 = paddle.randn([2, 3]).astype("float64")
input2 = input1.detach().clone()
input1.stop_gradient = False
input2.stop_gradient = False
z = tanh.apply(x1=input1, func1=paddle.tanh)
'''

# 3a. The wrong example: forward returns no Tensor.
SCRIPT_NO_TENSOR = IMPORTS + '''
# 错误示例
class cus_tanh(PyLayer):
    @staticmethod
    def forward(ctx, x1, x2):
        y = x1+x2
        # y.shape: 列表类型,非Tensor,输出至少包含一个Tensor
        return y.shape

    @staticmethod
    def backward(ctx, dy):
        return dy, dy

data = paddle.randn([2, 3], dtype="float32")
data.stop_gradient = False
# 由于forward输出没有Tensor引发报错
z, y_shape = cus_tanh.apply(data, data)
'''

# 3b. The right one: a Tensor and a non-Tensor output; the same input twice.
SCRIPT_MIXED_OUTPUTS = IMPORTS + '''
# 正确示例
class cus_tanh(PyLayer):
    @staticmethod
    def forward(ctx, x1, x2):
        y = x1+x2
        # y.shape: 列表类型,非Tensor
        return y, y.shape

    @staticmethod
    def backward(ctx, dy):
        # forward两个Tensor输入,因此,backward有两个输出。
        return dy, dy

data = paddle.randn([2, 3], dtype="float32")
data.stop_gradient = False
z, y_shape = cus_tanh.apply(data, data)
z.mean().backward()

print(data.grad)
'''

# 4. A stop_gradient input gets None from backward.
SCRIPT_STOP_GRADIENT = IMPORTS + '''
class cus_tanh(PyLayer):
    @staticmethod
    def forward(ctx, x1, x2):
        y = x1+x2
        return y

    @staticmethod
    def backward(ctx, dy):
        # x2.stop_gradient=True,其对应梯度需要返回None
        return dy, None


data1 = paddle.randn([2, 3], dtype="float32")
data1.stop_gradient = False
data2 = paddle.randn([2, 3], dtype="float32")
z = cus_tanh.apply(data1, data2)
fake_loss = z.mean()
fake_loss.backward()
print(data1.grad)
'''

# 5. No input needs a gradient: backward does not run.
SCRIPT_NO_BACKWARD = IMPORTS + '''
class cus_tanh(PyLayer):
    @staticmethod
    def forward(ctx, x1, x2):
        y = x1+x2
        return y

    @staticmethod
    def backward(ctx, dy):
        return dy, None


data1 = paddle.randn([2, 3], dtype="float32")
data2 = paddle.randn([2, 3], dtype="float32")
z = cus_tanh.apply(data1, data2)
fake_loss = z.mean()
fake_loss.backward()
# 因为data1.stop_gradient = True、data2.stop_gradient = True,所以backward不会被执行。
print(data1.grad is None)
'''


def run(script, paddle=None):
    """Runs a script's text; returns (its globals, what it printed). With
    `paddle`, its import line binds that object instead of the opjit module."""
    g = {"__name__": "seed_script"}
    if paddle is not None:
        script = script.replace("import opjit as paddle", "paddle = daemon_paddle")
        g["daemon_paddle"] = paddle
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(script, "<seed 002>", "exec"), g)
    return g, out.getvalue()


def printed_array(text):
    """The numbers of a printed ndarray."""
    return np.array([float(v) for v in text.replace("[", " ").replace("]", " ").split()])


# Random inputs: where tanh(x)^2 nears 1, float32's 1 - tanh^2 loses relative
# precision, so the comparisons have an absolute floor.
def test_cus_tanh_as_written():
    g, out = run(SCRIPT_TANH)
    data = g["data"]
    assert data.dtype == np.float32 and data.shape == (2, 3)
    want = (1 - np.tanh(data.numpy()) ** 2) / 6
    np.testing.assert_allclose(g["data"].grad, want, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(printed_array(out), want.reshape(-1), rtol=1e-5, atol=1e-7)
    assert g["z"].grad_fn is not None


def test_cus_tanh_prints_the_seeds_numbers(monkeypatch):
    # data.grad = (1 - tanh(x)^2) / 6, so the seed's x was +-atanh(sqrt(1 - 6 g)).
    x = np.arctanh(np.sqrt(1 - 6 * SEED_GRAD.astype(np.float64))).astype(np.float32)
    monkeypatch.setattr(opjit, "randn", lambda shape, dtype="float32": opjit.Tensor(x))
    g, out = run(SCRIPT_TANH)
    print(out)
    np.testing.assert_allclose(g["data"].grad, SEED_GRAD, rtol=2e-6)
    np.testing.assert_allclose(printed_array(out), SEED_GRAD.reshape(-1), rtol=2e-6)


def test_cus_tanh_with_the_daemons_kernels(client, grad_ops, backward_supported):
    # paddle.tanh and paddle.square are the daemon's Tanh and Square kernels.
    daemon_paddle = types.SimpleNamespace(tanh=client.op("tanh"), square=client.op("square"),
                                          randn=opjit.randn)
    g, out = run(SCRIPT_TANH, paddle=daemon_paddle)
    data = g["data"].numpy()
    want = (1 - np.tanh(data) ** 2) / 6
    np.testing.assert_allclose(g["data"].grad, want, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(printed_array(out), want.reshape(-1), rtol=1e-5, atol=1e-7)


def test_ctx_attribute_and_keyword_apply():
    g, out = run(SCRIPT_CTX_ATTR)
    input1, input2, z = g["input1"], g["input2"], g["z"]
    assert input1.dtype == np.float64 and z.dtype == np.float64
    np.testing.assert_array_equal(input2.numpy(), input1.numpy())
    assert not input2.stop_gradient and input2.grad_fn is None
    np.testing.assert_allclose(z.numpy(), np.tanh(input1.numpy()))
    # Going on as a user would: the backward uses ctx.func (paddle.square).
    z.mean().backward()
    np.testing.assert_allclose(input1.grad, (1 - np.tanh(input1.numpy()) ** 2) / 6)


def test_forward_without_a_tensor_output_is_refused():
    # Paddle raises ValueError: "At least one output of `PyLayer.forward` is a `Tensor`."
    with pytest.raises(ValueError, match="At least one output of `PyLayer.forward` is a"):
        run(SCRIPT_NO_TENSOR)


def test_tensor_and_non_tensor_outputs():
    g, out = run(SCRIPT_MIXED_OUTPUTS)
    assert g["y_shape"] == (2, 3)
    want = np.full((2, 3), 2 / 6, np.float32)  # dy reaches data twice
    np.testing.assert_allclose(g["data"].grad, want)
    np.testing.assert_allclose(printed_array(out), want.reshape(-1))


def test_stop_gradient_input_returns_none():
    g, out = run(SCRIPT_STOP_GRADIENT)
    np.testing.assert_allclose(g["data1"].grad, np.full((2, 3), 1 / 6, np.float32))
    assert g["data2"].grad is None
    np.testing.assert_allclose(printed_array(out), np.full(6, 1 / 6), rtol=1e-6)


def test_no_backward_when_nothing_needs_a_grad():
    g, out = run(SCRIPT_NO_BACKWARD)
    assert out == "True\n"
    assert g["fake_loss"].grad_fn is None
