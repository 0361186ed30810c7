"""The ResNet's max pool with its written-out gradient (cleanba_utils/max_pool.py) against JAX's own
gradient of flax's max pool, bit for bit, and against a plain loop over the windows."""

import flax.linen as nn
import jax
import numpy as np
import pytest

from cleanba_utils.max_pool import max_pool_3x3_stride_2


def flax_max_pool(x):
    return nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")


def gradient_function(pool):
    """x, the pool's output gradient -> x's gradient, compiled once per shape."""
    return jax.jit(lambda x, grad_pooled: jax.vjp(pool, x)[1](grad_pooled)[0])


OUR_GRADIENT = gradient_function(max_pool_3x3_stride_2)
FLAX_GRADIENT = gradient_function(flax_max_pool)


def bits(a):
    return np.asarray(a, np.float32).view(np.uint32)


@pytest.mark.parametrize("shape", [(3, 84, 84, 4), (2, 21, 21, 5), (2, 10, 13, 2), (1, 1, 1, 1)])
@pytest.mark.parametrize("values", ["ties", "distinct"])
def test_the_gradient_is_jaxs_bit_for_bit(shape, values):
    """Ties (few distinct values) decide which element a window's gradient goes to; gradients of
    -0 decide the signs of zero sums."""
    rng = np.random.default_rng(sum(shape))
    if values == "ties":
        x = rng.integers(0, 3, shape).astype(np.float32)
    else:
        x = rng.normal(size=shape).astype(np.float32)
    pooled = np.asarray(max_pool_3x3_stride_2(x))
    assert np.array_equal(bits(pooled), bits(flax_max_pool(x)))
    grad_pooled = rng.normal(size=pooled.shape).astype(np.float32)
    grad_pooled[rng.random(pooled.shape) < 0.2] = -0.0
    ours = OUR_GRADIENT(x, grad_pooled)
    assert np.array_equal(bits(ours), bits(FLAX_GRADIENT(x, grad_pooled)))


def test_the_gradient_of_a_plain_loop_over_the_windows():
    """Each window passes its gradient to its first maximal element in row-major order; an element
    sums what it is passed in the windows' row-major order."""
    rng = np.random.default_rng(0)
    x = rng.integers(0, 4, (2, 7, 8, 3)).astype(np.float32)
    grad_pooled = rng.normal(size=(2, 4, 4, 3)).astype(np.float32)
    expected = np.zeros_like(x)
    # SAME: 7 rows take 2 * 4 + 1 - 7 = 2 padded rows, 1 before; 8 columns 1 padded column, after.
    for n, i, j, c in np.ndindex(grad_pooled.shape):
        window = [
            (row, col)
            for row in range(2 * i - 1, 2 * i + 2)
            for col in range(2 * j, 2 * j + 3)
            if 0 <= row < 7 and col < 8
        ]
        values = [x[n, row, col, c] for row, col in window]
        row, col = window[values.index(max(values))]
        expected[n, row, col, c] += grad_pooled[n, i, j, c]
    assert np.array_equal(np.asarray(OUR_GRADIENT(x, grad_pooled)), expected)


def test_the_gradient_under_grad_of_a_network():
    """Inside `jax.grad` of a small ResNet stack: the same parameters' gradients as flax's pool."""

    class Stack(nn.Module):
        pool: object

        @nn.compact
        def __call__(self, x):
            x = nn.Conv(4, (3, 3))(x)
            return self.pool(x).sum() + (self.pool(nn.relu(x)) ** 2).sum()

    x = np.random.default_rng(1).normal(size=(2, 12, 12, 3)).astype(np.float32)
    params = Stack(flax_max_pool).init(jax.random.PRNGKey(0), x)
    gradients = [
        jax.jit(jax.grad(lambda p, pool=pool: Stack(pool).apply(p, x)))(params)
        for pool in (flax_max_pool, max_pool_3x3_stride_2)
    ]
    for ours, reference in zip(jax.tree.leaves(gradients[1]), jax.tree.leaves(gradients[0])):
        assert np.array_equal(bits(ours), bits(reference))
