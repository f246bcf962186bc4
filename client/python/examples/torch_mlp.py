#!/usr/bin/env python3
"""A PyTorch nn.Module with an opjit op inside, trained for a few hundred steps.

A 2-layer MLP on synthetic data whose activation is opjit's `tanh`
(kernels/examples/tanh.cc, with its registered bprop `tanh_grad`), called
through opjit.torch, next to the same model with torch.tanh: the loss
decreases, and the gradients match the torch model's. Needs PyTorch
(Debian's python3-torch: deploy/install-deps.sh installs it) and a running
opjitd ($OPJIT_SERVER or the default socket):

    PYTHONPATH=build/python /usr/bin/python3 client/python/examples/torch_mlp.py
"""
import os
import sys
import time
import warnings

try:
    import torch
except ImportError:
    # Exits 0 so that the examples' suite stays green where torch is absent.
    print("torch_mlp.py: skipped: PyTorch is not installed "
          "(deploy/install-deps.sh installs python3-torch)")
    sys.exit(0)

import opjit
import opjit.torch as ot

KERNELS = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                        "..", "..", "..", "kernels", "examples"))

# The ops live in a namespace of their own: torch.ops.opjit.torch_mlp__tanh.
client = opjit.Client(namespace="torch_mlp")
with warnings.catch_warnings():  # the specs give no output rule: outputs are shaped as x
    warnings.simplefilter("ignore", opjit.OpjitWarning)
    client.register(os.path.join(KERNELS, "tanh_grad.json"))  # dx = dy * (1 - y^2)
    client.register(os.path.join(KERNELS, "tanh.json"))       # y = tanh(x); backward: tanh_grad
ot.set_default_client(client)


class MLP(torch.nn.Module):
    def __init__(self, act, hidden=32):
        super().__init__()
        torch.manual_seed(0)  # both models start from the same weights
        self.fc1 = torch.nn.Linear(8, hidden)
        self.fc2 = torch.nn.Linear(hidden, 1)
        self.act = act

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def main():
    model = MLP(ot.op("tanh"))    # the opjit op as the activation
    ref = MLP(torch.tanh)         # the same model with torch's own op
    g = torch.Generator().manual_seed(1)
    X = torch.randn(256, 8, generator=g)
    Y = torch.tanh(X[:, :4].sum(1, keepdim=True) / 2) + 0.05 * torch.randn(256, 1, generator=g)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref)]
    steps, batch = 300, 32
    first = last = None
    worst = 0.0
    t0 = time.perf_counter()
    for step in range(steps):
        i = (step * batch) % len(X)
        xb, yb = X[i:i + batch], Y[i:i + batch]
        losses = []
        for m, opt in zip((model, ref), opts):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(m(xb), yb)
            loss.backward()
            losses.append(loss.item())
        for p, q in zip(model.parameters(), ref.parameters()):
            worst = max(worst, (p.grad - q.grad).abs().max().item())
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5)
        for opt in opts:
            opt.step()
        first = losses[0] if first is None else first
        last = losses[0]
        if step % 50 == 0 or step == steps - 1:
            print("step %3d  loss %.4f  (torch.tanh model: %.4f)" % (step, losses[0], losses[1]))
    elapsed = time.perf_counter() - t0
    assert last < 0.5 * first, (first, last)
    print("grads match torch.tanh's within %.2g over %d steps" % (worst, steps))

    model.eval()
    with torch.no_grad():  # inference: a whole batch, no graph
        pred = model(X)
        assert pred.grad_fn is None and pred.shape == (256, 1)
        print("eval mse %.4f (torch.tanh model: %.4f)"
              % (torch.nn.functional.mse_loss(pred, Y).item(),
                 torch.nn.functional.mse_loss(ref(X), Y).item()))
    print("%d training steps in %.2f s; fast path calls: %s"
          % (steps, elapsed, client.call_counts()))
    client.close()
    print("ok")


if __name__ == "__main__":
    main()
