"""The one exception for bad user input, raised before anything compiles or loads data.

A neutral module (no jax, no numpy): every package (algorithms, cluster, data, models, experiments) and the
config helpers may raise it.
"""

import math
import numbers


class ConfigError(ValueError):
  """A config field has a value that is not allowed.

  The message names the field, the value and what is allowed, in one line, e.g.
  `algorithm.local_steps=0 is not allowed: must be an integer >= 1`.
  """

  _MESSAGE_ONLY = object()

  def __init__(self, field: str, value=_MESSAGE_ONLY, allowed: str = ''):
    # With one argument (as when a library re-raises the exception with its message) it is the message.
    self.field, self.value, self.allowed = field, value, allowed
    if value is ConfigError._MESSAGE_ONLY:
      super().__init__(field)
    else:
      super().__init__(f'{field}={value!r} is not allowed: {allowed}')


def require(condition: bool, field: str, value, allowed: str) -> None:
  """Raises ConfigError(field, value, allowed) unless `condition`."""
  if not condition:
    raise ConfigError(field, value, allowed)


def require_int(value, field: str, minimum: int, maximum: int | None = None) -> None:
  """`value` must be an int in [minimum, maximum]."""
  ok = isinstance(value, int) and not isinstance(value, bool) and value >= minimum
  ok = ok and (maximum is None or value <= maximum)
  bound = f'>= {minimum}' if maximum is None else f'in {minimum}..{maximum}'
  require(ok, field, value, f'must be an integer {bound}')


def require_number(value, field: str, allowed: str, ok=lambda v: True) -> None:
  """`value` must be a finite real number (not a bool) with `ok(value)`; `allowed` says what is allowed."""
  number = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
  require(number and ok(value), field, value, allowed)
