"""`WeightsWatch` (kvcanary.runtime.weights): which weight changes bump the version, at what cost, and what it leaves
as it found it."""
from __future__ import annotations

import torch

from kvcanary.runtime.weights import WeightsWatch


def test_watch_sees_submodule_loads_and_the_models_optimizers_only():
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(12)])
    other = torch.nn.Linear(4, 4)
    watch = WeightsWatch(net)
    watch.install()
    assert watch.current() == 0 and len(watch._watched) == 8  # sentinels, not every parameter
    net[5].load_state_dict({k: v * 2 for k, v in net[5].state_dict().items()})  # no sentinel in net[5]
    assert watch.current() == 1 and watch.current() == 1
    opt = torch.optim.SGD(other.parameters(), lr=0.1)
    other(torch.ones(1, 4)).sum().backward()
    opt.step()
    assert watch.current() == 1  # another model's optimizer
    opt = torch.optim.SGD(net[5].parameters(), lr=0.1)
    net(torch.ones(1, 4)).sum().backward()
    opt.step()
    assert watch.current() == 2
    with torch.no_grad():
        net[0].weight.mul_(2)  # a sentinel
    assert watch.current() == 3
    assert watch.bump() == 4 and watch.current() == 4
    watch.remove()
    net.load_state_dict(net.state_dict())
    assert watch.current() == 4  # disarmed


def test_watch_takes_inference_mode_models():
    with torch.inference_mode():
        net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    net2 = torch.nn.Linear(4, 4)
    net.add_module("tracked", net2)
    watch = WeightsWatch(net)
    watch.install()  # inference tensors keep no version counter: not sentinels, the hooks still see loads
    assert all(p is not None for p in watch._watched) and len(watch._watched) == 2
    with torch.inference_mode():
        net.load_state_dict(net.state_dict())
    assert watch.current() == 1


def test_watched_methods_bump_when_they_return_and_are_restored_on_remove():
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = torch.nn.Linear(4, 4)
            self.calls = 0

        def load_weights(self, weights):
            for name, t in weights:  # an engine's loader: writes through .data, no version counter moves
                self.get_parameter(name).data.copy_(t)
            self.calls += 1
            return {name for name, _ in weights}

    m = Model()
    watch = WeightsWatch(m, methods=("load_weights", "no_such_method"))
    watch.install()
    assert watch.methods == ("load_weights",) and "load_weights" in m.__dict__
    assert m.load_weights([("inner.bias", torch.zeros(4))]) == {"inner.bias"} and m.calls == 1
    assert watch.current() == 1
    m.inner.bias.data.add_(1)  # the documented blind spot
    assert watch.current() == 1
    watch.remove()
    assert "load_weights" not in m.__dict__
    m.load_weights([])
    assert m.calls == 2 and watch.current() == 1
