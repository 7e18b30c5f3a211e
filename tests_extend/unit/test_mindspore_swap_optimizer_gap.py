"""--swap-optimizer stays refused on the MindSpore trainer because MindSpore 2.10 cannot release a
Parameter's memory on CPU: Parameter._offload() (Ascend-only) leaves the data where it was. When a
MindSpore release frees it there, this test fails: the refusal can then be lifted."""
import numpy as np
import pytest

from mindspeed.backends.base import Level
from mindspeed.features.registry import get_feature
from mindspeed.support_matrix import feature_level


def test_the_refusal_names_the_missing_mindspore_capability():
    level, limits = feature_level(get_feature("swap-optimizer"), "mindspore", "cpu")
    assert level is Level.ABSENT and any("MindSpore 2.10" in lim and "_offload" in lim for lim in limits), limits


def test_offloading_a_parameter_on_cpu_releases_nothing():
    ms = pytest.importorskip("mindspore")
    moment = ms.Parameter(ms.Tensor(np.arange(4096, dtype=np.float32)), name="exp_avg")
    address = moment._data_ptr()
    moment._offload()
    assert moment._data_ptr() == address            # the same memory, still held
    np.testing.assert_array_equal(moment.asnumpy(), np.arange(4096, dtype=np.float32))
