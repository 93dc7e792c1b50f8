"""jaxinfer/parallel/transfer.py: a step's host arrays packed into one buffer and cut back on the
device bit for bit (the multi-device placement runs in tests/test_parallel.py's engine checks)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.parallel.transfer import ALIGN, pack, packed_size, put_tree, unpack


def _leaves(rng) -> list[np.ndarray]:
    out = []
    for _ in range(9):
        shape = tuple(int(d) for d in rng.integers(0, 5, rng.integers(0, 3)))
        kind = rng.integers(3)
        if kind == 0:
            out.append(rng.integers(-2**31, 2**31 - 1, shape, dtype=np.int32))
        elif kind == 1:
            out.append(rng.integers(0, 2**32 - 1, shape, dtype=np.uint32))
        else:
            leaf = rng.standard_normal(shape).astype(np.float32)
            if leaf.size:
                leaf.reshape(-1)[0] = -np.inf
            out.append(leaf)
    return out


def _bits(a) -> np.ndarray:
    return np.asarray(a).reshape(-1).view(np.uint32)


@pytest.mark.parametrize("seed", range(4))
def test_pack_then_unpack_gives_every_leaf_bit_for_bit(seed):
    leaves = _leaves(np.random.default_rng(seed))
    buf, layout = pack(leaves)
    assert buf.dtype == np.int32 and buf.size == packed_size(leaves)
    # each leaf on a 256-byte boundary: a Mosaic GPU kernel given a view into the buffer needs it
    assert all(offset % ALIGN == 0 for offset, _, _ in layout) and ALIGN * 4 == 256
    for got in (unpack(jnp.asarray(buf), layout), jax.jit(lambda b: unpack(b, layout))(buf)):
        for want, leaf in zip(leaves, got):
            assert leaf.shape == want.shape and leaf.dtype == want.dtype
            np.testing.assert_array_equal(_bits(leaf), _bits(want))


def test_put_tree_places_host_leaves_and_keeps_the_rest():
    leaves = _leaves(np.random.default_rng(7))
    on_device = jnp.arange(3)
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    tree = {"host": leaves, "device": on_device, "none": None}
    placed = put_tree(tree, sharding)
    assert placed["device"] is on_device and placed["none"] is None
    for want, leaf in zip(leaves, placed["host"]):
        assert isinstance(leaf, jax.Array) and leaf.sharding == sharding
        np.testing.assert_array_equal(_bits(leaf), _bits(want))


def test_put_tree_without_a_sharding_leaves_its_leaves_uncommitted():
    """The one-device step path: placed on the default device but uncommitted, as a jit's own
    placement of numpy arguments would leave them (jit keys its cache on that)."""
    leaves = _leaves(np.random.default_rng(8))
    placed = put_tree(leaves, None)
    for want, leaf in zip(leaves, placed):
        assert isinstance(leaf, jax.Array) and not leaf.committed
        assert leaf.devices() == {jax.devices()[0]}
        np.testing.assert_array_equal(_bits(leaf), _bits(want))


def test_pack_refuses_leaves_that_are_not_four_bytes():
    with pytest.raises(TypeError, match="4-byte"):
        pack([np.zeros(3, np.int64)])
