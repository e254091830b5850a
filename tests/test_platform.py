"""Device probes: abstract devices used for lowering on CPU and inside shard_map."""

import jax

from jaxfp8 import _platform


def _with_abstract_device(device_kind, num_cores, platform, fn):
  device = jax.sharding.AbstractDevice(device_kind=device_kind, num_cores=num_cores, platform=platform)
  with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=device)):
    return fn()


def test_abstract_h200_is_hopper_with_132_sms():
  with _platform.abstract_h200():
    assert _platform.abstract_device_capability() == (9, 0)
    assert _platform.num_sms() == _platform.H200_NUM_SMS == 132


def test_other_abstract_gpus_are_not_taken_for_hopper():
  assert _with_abstract_device("NVIDIA L40S", 142, "gpu", _platform.abstract_device_capability) is None
  assert _with_abstract_device("NVIDIA H100 80GB HBM3", 132, "gpu", _platform.abstract_device_capability) == (9, 0)
  assert _with_abstract_device("cpu", None, "cpu", _platform.abstract_device_capability) is None


def test_num_sms_never_none():
  # A CPU mesh's abstract device has no core count (inside shard_map): grids are sized for an H200 then.
  assert _with_abstract_device("cpu", None, "cpu", _platform.num_sms) == _platform.H200_NUM_SMS
  assert _platform.num_sms() > 0
