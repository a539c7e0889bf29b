"""The shared bitwise comparison in tests/_helpers.py fails where it should."""

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tests._helpers import assert_tree_bitwise, tree_diff


def test_equal_trees_pass_and_nans_compare_equal():
    a = {"w": np.array([1.0, np.nan], np.float32), "k": jax.random.key(0)}
    assert_tree_bitwise(a, {"w": np.array([1.0, np.nan], np.float32), "k": jax.random.key(0)},
                        sharding=False)


@pytest.mark.parametrize(("b", "why"), [
    ({"w": np.array([1.0, 2.0], np.float32)}, "values differ"),
    ({"w": np.array([1.0, np.nan], np.float64)}, "float64"),
    ({"w": np.array([[1.0, np.nan]], np.float32)}, "(1, 2)"),
    ({"v": np.array([1.0, np.nan], np.float32)}, "tree structure"),
])
def test_differences_are_reported(b, why):
    bad = tree_diff({"w": np.array([1.0, np.nan], np.float32)}, b, sharding=False)
    assert len(bad) == 1 and why in bad[0], bad


def test_typed_keys_compare_by_key_data():
    assert tree_diff(jax.random.key(0), jax.random.key(1), sharding=False) == [": values differ (bytes)"]


def test_exact_compares_bytes():
    zero, negzero = np.zeros(3, np.float32), -np.zeros(3, np.float32)
    assert_tree_bitwise(zero, negzero, sharding=False, exact=False)  # equal values ...
    with pytest.raises(AssertionError, match="bytes"):  # ... different bits: bitwise by default
        assert_tree_bitwise(zero, negzero, sharding=False)


def test_sharding_is_compared():
    mesh = jax.make_mesh((8,), ("m",), axis_types=(jax.sharding.AxisType.Auto,))
    x = np.arange(16.0, dtype=np.float32)
    a, b = (jax.device_put(x, NamedSharding(mesh, s)) for s in (P("m"), P()))
    assert_tree_bitwise(a, b, sharding=False)
    with pytest.raises(AssertionError, match="sharding"):
        assert_tree_bitwise(a, b)
