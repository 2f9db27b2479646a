"""JAX's persistent compilation cache, switched on for every program (`--compilation_cache_dir`), and the compiler
options of the small one-off programs of a run's start (`quick_compile_options`)."""

from __future__ import annotations

import contextlib
import os

SETTINGS = ('jax_compilation_cache_dir', 'jax_persistent_cache_min_compile_time_secs',
            'jax_persistent_cache_min_entry_size_bytes', 'jax_compilation_cache_max_size')
ENV = 'WAITLESS_COMPILATION_CACHE_DIR'  # the user's cache directory; set to '' for none
MAX_BYTES = 2 * 2 ** 30  # the cache's bound: JAX evicts the least recently used programs beyond it


def user_dir() -> str:
  """The cache `experiments.main` uses unless told otherwise: $WAITLESS_COMPILATION_CACHE_DIR when set ('' for
  none), else $XDG_CACHE_HOME/waitless/jax (~/.cache/waitless/jax)."""
  if ENV in os.environ:
    return os.environ[ENV]
  return os.path.join(os.environ.get('XDG_CACHE_HOME') or os.path.expanduser('~/.cache'), 'waitless', 'jax')


def enable(path: str) -> None:
  """JAX's persistent compilation cache in `path`, for every program however fast it compiles, at most
  MAX_BYTES (least recently used programs evicted).

  A cache hit loads the executable compiled before for the same program, options, devices and JAX version, so
  results are bit-identical; on a 10-step digits run it saves most of the start-up's compiling.
  """
  import jax
  jax.config.update('jax_compilation_cache_dir', os.path.abspath(path))
  jax.config.update('jax_persistent_cache_min_compile_time_secs', 0.0)
  jax.config.update('jax_persistent_cache_min_entry_size_bytes', 0)
  jax.config.update('jax_compilation_cache_max_size', MAX_BYTES)


@contextlib.contextmanager
def enabled(path: str):
  """`enable(path)` for the duration of the block; the previous settings afterwards.

  JAX opens its cache once, at the first compile, and keeps writing there whatever the settings say later: the
  cache is reset on the way in and out (a private hook, `jax._src.compilation_cache.reset_cache`), or programs
  compiled after the block would be written to `path` (a deleted temporary directory: a warning per program)."""
  import jax
  from jax._src import compilation_cache as jax_cache
  previous = {name: getattr(jax.config, name) for name in SETTINGS}
  jax_cache.reset_cache()
  enable(path)
  try:
    yield
  finally:
    for name, value in previous.items():
      jax.config.update(name, value)
    jax_cache.reset_cache()


# XLA:CPU's LLVM -O1 instead of its default -O2: about a quarter of the compile time for the same values. Integer
# ops are exact at any level, and float ops follow the same IEEE rules at -O1 as at -O2, FMA contraction included
# (at -O0 LLVM contracts none: other values).
_CPU_QUICK = {'xla_backend_optimization_level': 1}


def quick_compile_options(platform: str) -> dict[str, int] | None:
  """`compiler_options` for a program that runs once or rarely, where compiling costs more than running: the
  model's initialisation (a long chain of integer ops for the random bits, most of a short CPU run's compile
  time) and the checkpoints' checksums. On CPU -O1; other platforms keep their defaults (None).

  The initialisation's values are checked against the default compile in
  tests/experiments/harness/test_initial_state.py.
  """
  return dict(_CPU_QUICK) if platform == 'cpu' else None
