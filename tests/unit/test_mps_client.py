"""gpuos.workloads.mps_client's iteration without a GPU: where its phase marks fall (the
benchmark's --phases reads them to say where a released standby's first iteration went)."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest

from gpuos.workloads.mps_client import iteration


class Recorder:
    """A torch stand-in that writes down every call, and the marks between them."""

    def __init__(self):
        self.calls: list[str] = []
        rec = self

        class Loss:
            def backward(self):
                rec.calls.append("backward")

        self.cuda = SimpleNamespace(synchronize=lambda: rec.calls.append("sync"))
        self.nn = SimpleNamespace(functional=SimpleNamespace(
            mse_loss=lambda out, y: (rec.calls.append("loss"), Loss())[1]))
        self.inference_mode = contextlib.nullcontext

    def randn(self, *shape, device=None):
        self.calls.append("randn")
        return SimpleNamespace(sum=lambda: self.calls.append("sum"))

    @property
    def model(self):
        """Like a torch.nn.Sequential of two layers: callable whole, or layer by layer."""
        rec = self

        class Model:
            def __call__(self, x):
                rec.calls.append("model")
                return x

            def __iter__(self):
                for i in range(2):
                    yield lambda x, i=i: (rec.calls.append(f"layer{i}"), x)[1]
        return Model()

    def opt(self):
        rec = self
        return SimpleNamespace(zero_grad=lambda set_to_none: rec.calls.append("zero_grad"),
                               step=lambda: rec.calls.append("step"))


@pytest.mark.parametrize("train", [False, True])
def test_marks_follow_their_phases_and_the_iteration_ends_synchronized(train):
    t = Recorder()
    iteration(t, "cuda", t.model, t.opt() if train else None, 8, 4,
              mark=lambda phase: t.calls.append(f"mark:{phase}"))
    if train:
        assert t.calls == ["randn", "mark:inputs", "randn", "layer0", "mark:layer0", "layer1",
                           "mark:layer1", "loss", "mark:forward", "zero_grad", "backward",
                           "mark:backward", "step", "mark:step", "sync"]
    else:
        assert t.calls == ["randn", "mark:inputs", "layer0", "mark:layer0", "layer1", "mark:layer1",
                           "sum", "mark:forward", "sync"]
    # no marks asked for: the same calls without them, the model called whole
    t.calls.clear()
    iteration(t, "cuda", t.model, t.opt() if train else None, 8, 4)
    assert "sync" == t.calls[-1] and not [c for c in t.calls if c.startswith("mark")]
    assert "model" in t.calls and not [c for c in t.calls if c.startswith("layer")]
