"""A Ray run's pieces on one device: the config's `setup.Run` for the server, a learner or the driver."""

from __future__ import annotations

from waitless.experiments.harness import setup
from waitless.experiments.harness.ray_runtime import ray_config


def build(config) -> setup.Run:
  """`setup.build` of `ray_config.server_config(config)`: the P learners' state vmapped on one device."""
  return setup.build(ray_config.server_config(config))
