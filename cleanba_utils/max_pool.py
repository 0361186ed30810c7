"""The IMPALA ResNet's max pool (3x3 windows, stride 2, SAME padding) with its gradient written out.

JAX differentiates a max pool into XLA's select-and-scatter, which XLA's CPU backend expands into
four index arrays of the input's size, a variadic reduce-window and a scatter (their cost in a
learner update, and this gradient's: benchmark/results/speed_cpu.md, 2026-11-25). The gradient here
is the same, bit for bit (inputs without NaN): each window passes its output's gradient to its first
maximal element in row-major order (select-and-scatter's `>=` selection), and each input element
sums, from +0, what its windows pass it, in the windows' row-major order (the scatter's order). It
also fixes that order where a backend's scatter would add concurrently."""

import flax.linen as nn
import jax
import jax.numpy as jnp

WINDOW_OFFSETS = tuple((row, col) for row in range(3) for col in range(3))
"""A window's elements as (row, column) offsets, in row-major order."""

ROW_TERMS = {0: ((2, 1), (0, 0)), 1: ((1, 0),)}
"""Which windows reach a padded row, by the row's parity, in the windows' order: as (the row's
offset in the window, the shift from the window's index to the row's pair index). Row 2a is row
offset 2 of window a - 1, then row offset 0 of window a; row 2a + 1 is row offset 1 of window a.
Columns likewise."""


@jax.custom_vjp
def max_pool_3x3_stride_2(x):
    """`nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")` of x (N, H, W, C)."""
    return nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")


def max_pool_forward(x):
    pooled = max_pool_3x3_stride_2(x)
    return pooled, (x, pooled)


def max_pool_backward(residuals, grad_pooled):
    x, pooled = residuals
    batch, height, width, channels = x.shape
    _, out_height, out_width, _ = pooled.shape
    # SAME padding makes the input exactly as large as the windows cover (2 * out + 1 rows and
    # columns), with the smaller half before it; padded elements are -inf. One more row and
    # column after it split the rows (columns) into pairs: padded row 2a + p is pair a, parity p.
    pad_rows = 2 * out_height + 1 - height
    pad_cols = 2 * out_width + 1 - width
    top = pad_rows // 2
    left = pad_cols // 2
    padded = jnp.pad(
        x,
        ((0, 0), (top, pad_rows - top + 1), (left, pad_cols - left + 1), (0, 0)),
        constant_values=-jnp.inf,
    )
    pairs = padded.reshape(batch, out_height + 1, 2, out_width + 1, 2, channels)

    def window_elements(row, col):
        """Every window's element at offset (row, col): window (i, j) reads padded row 2i + row,
        column 2j + col."""
        rows = slice(row // 2, row // 2 + out_height)
        cols = slice(col // 2, col // 2 + out_width)
        return pairs[:, rows, row % 2, cols, col % 2]

    # The index in WINDOW_OFFSETS of each window's first maximal element.
    first_maximum = jnp.full(pooled.shape, len(WINDOW_OFFSETS) - 1, jnp.int32)
    for index in reversed(range(len(WINDOW_OFFSETS) - 1)):
        is_maximal = window_elements(*WINDOW_OFFSETS[index]) == pooled
        first_maximum = jnp.where(is_maximal, index, first_maximum)
    # The scatter adds into +0, so no gradient it gives is -0. XLA folds `0 + g` into `g`: -0
    # becomes +0 before any sum, which then never meets a -0 either.
    zero = jnp.zeros((), grad_pooled.dtype)
    grad_pooled = jnp.where(grad_pooled == 0, zero, grad_pooled)
    passed = {
        offset: jnp.where(first_maximum == index, grad_pooled, zero)
        for index, offset in enumerate(WINDOW_OFFSETS)
    }
    # Each padded element's gradient, by the parities of its row and column.
    by_row_parity = []
    for row_parity in (0, 1):
        by_col_parity = []
        for col_parity in (0, 1):
            total = jnp.zeros((batch, out_height + 1, out_width + 1, channels), grad_pooled.dtype)
            for row, row_shift in ROW_TERMS[row_parity]:
                for col, col_shift in ROW_TERMS[col_parity]:
                    widths = (
                        (0, 0),
                        (row_shift, 1 - row_shift),
                        (col_shift, 1 - col_shift),
                        (0, 0),
                    )
                    total = total + jnp.pad(passed[row, col], widths)
            by_col_parity.append(total)
        by_row_parity.append(jnp.stack(by_col_parity, axis=3))
    grad_padded = jnp.stack(by_row_parity, axis=2).reshape(padded.shape)
    return (grad_padded[:, top : top + height, left : left + width],)


max_pool_3x3_stride_2.defvjp(max_pool_forward, max_pool_backward)
