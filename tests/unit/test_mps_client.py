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


class Stateful:
    def __init__(self, state):
        self.state = state

    def state_dict(self):
        return dict(self.state)

    def load_state_dict(self, state):
        self.state = dict(state)


def test_a_checkpoint_is_written_aside_and_resumed_from(tmp_path):
    """--checkpoint: the state and iteration saved (renamed into place, nothing left aside)
    and read back into a new run's model and optimizer."""
    import pickle

    from gpuos.workloads.mps_client import load_checkpoint, save_checkpoint

    def save(obj, path):
        with open(path, "wb") as f:
            pickle.dump(obj, f)

    def load(path, map_location=None):
        with open(path, "rb") as f:
            return pickle.load(f)

    torch = SimpleNamespace(save=save, load=load)
    path = str(tmp_path / "ckpt.pt")
    save_checkpoint(torch, path, Stateful({"w": 1}), Stateful({"m": 2}), 41)
    save_checkpoint(torch, path, Stateful({"w": 3}), Stateful({"m": 4}), 42)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt"]
    model, opt = Stateful({}), Stateful({})
    assert load_checkpoint(torch, "cuda", path, model, opt) == 42
    assert (model.state, opt.state) == ({"w": 3}, {"m": 4})
    infer = Stateful({})
    save_checkpoint(torch, path, Stateful({"w": 5}), None, 7)  # an inference loop: no optimizer
    assert load_checkpoint(torch, "cuda", path, infer, None) == 7 and infer.state == {"w": 5}
