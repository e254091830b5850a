"""examples/: each runs as documented (short) and shows what it claims."""

from __future__ import annotations

import importlib.util
import pathlib

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _load(name: str):
  spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_lora_beside_frozen_fp8_layers_learns_and_leaves_them_frozen():
  lora = _load("lora_fp8")
  fresh, *_ = lora.make_problem(0)
  losses, model = lora.train(steps=60, seed=0, log_every=0)
  assert all(np.isfinite(losses)) and losses[-1] < 0.05 * losses[0], losses[::10]
  # The FP8 codes and scales never moved; only the adapters did.
  for trained, base in ((model.first.base, fresh[0]), (model.second.base, fresh[1])):
    np.testing.assert_array_equal(np.asarray(trained.w_q[...]).view(np.uint8), np.asarray(base.w_q[...]).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(trained.w_s[...]), np.asarray(base.w_s[...]))
  assert np.abs(np.asarray(model.first.b[...])).sum() > 0  # the first adapter learned through the FP8 backward
