"""JAX's persistent compilation cache, switched on for every program (`--compilation_cache_dir`)."""

from __future__ import annotations

import contextlib
import os

SETTINGS = ('jax_compilation_cache_dir', 'jax_persistent_cache_min_compile_time_secs',
            'jax_persistent_cache_min_entry_size_bytes')


def enable(path: str) -> None:
  """JAX's persistent compilation cache in `path`, for every program however fast it compiles.

  Off by default: it is state shared across runs outside the workdir that grows without bound. A cache hit
  loads the executable compiled before for the same program, options, devices and JAX version, so results are
  bit-identical; on a 10-step digits run it saves the ~2 s of CPU time spent compiling.
  """
  import jax  # pylint: disable=g-import-not-at-top
  jax.config.update('jax_compilation_cache_dir', os.path.abspath(path))
  jax.config.update('jax_persistent_cache_min_compile_time_secs', 0.0)
  jax.config.update('jax_persistent_cache_min_entry_size_bytes', 0)


@contextlib.contextmanager
def enabled(path: str):
  """`enable(path)` for the duration of the block; the previous settings afterwards.

  JAX opens its cache once, at the first compile, and keeps writing there whatever the settings say later: the
  cache is reset on the way in and out (a private hook, `jax._src.compilation_cache.reset_cache`), or programs
  compiled after the block would be written to `path` (a deleted temporary directory: a warning per program)."""
  import jax  # pylint: disable=g-import-not-at-top
  from jax._src import compilation_cache as jax_cache  # pylint: disable=g-import-not-at-top
  previous = {name: getattr(jax.config, name) for name in SETTINGS}
  jax_cache.reset_cache()
  enable(path)
  try:
    yield
  finally:
    for name, value in previous.items():
      jax.config.update(name, value)
    jax_cache.reset_cache()
