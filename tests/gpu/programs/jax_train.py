"""JAX: a jit-compiled MLP trained with SGD on seeded random batches (XLA's BFC allocator).

Each step logs its loss exactly (float.hex); the end logs a hash of the parameters.
XLA preallocates XLA_PYTHON_CLIENT_MEM_FRACTION of the GPU (8% by default here).
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.08")
os.environ.setdefault("XLA_FLAGS", "--xla_gpu_deterministic_ops=true")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from steplog import StepLog, digest, parser  # noqa: E402

SIZES = (512, 1024, 1024, 10)


def init(key):
    params = []
    for i, (n_in, n_out) in enumerate(zip(SIZES[:-1], SIZES[1:])):
        k = jax.random.fold_in(key, i)
        params.append((jax.random.normal(k, (n_in, n_out)) * (1.0 / n_in) ** 0.5,
                       jnp.zeros((n_out,))))
    return params


def loss_fn(params, x, y):
    for w, b in params[:-1]:
        x = jax.nn.relu(x @ w + b)
    w, b = params[-1]
    logits = x @ w + b
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=1))


@jax.jit
def train_step(params, x, y):
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    return [(w - 0.05 * gw, b - 0.05 * gb) for (w, b), (gw, gb) in zip(params, grads)], loss


def main() -> None:
    args = parser(__doc__).parse_args()
    log = StepLog(args)
    key = jax.random.PRNGKey(args.seed)
    params = init(key)
    for step in range(args.steps):
        k = jax.random.fold_in(key, 1000 + step)
        x = jax.random.normal(k, (256, SIZES[0]))
        y = jax.random.randint(jax.random.fold_in(k, 1), (256,), 0, SIZES[-1])
        params, loss = train_step(params, x, y)
        log.step(step, "loss", float(loss).hex())
    flat = np.concatenate([np.asarray(a).ravel() for layer in params for a in layer])
    log.line(args.steps, "params", digest(flat.tobytes()))
    log.done()


if __name__ == "__main__":
    main()
