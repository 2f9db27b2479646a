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


def is_int(value) -> bool:
  """Whether `value` is an integer: a Python int or a numpy integer (`numbers.Integral`); a bool is not."""
  return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_number(value) -> bool:
  """Whether `value` is a finite real number: a Python or numpy integer or float (`numbers.Real`); a bool is not."""
  return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def require_int(value, field: str, minimum: int, maximum: int | None = None, why: str = '') -> None:
  """`value` must be an int in [minimum, maximum]: else `field=value is not allowed: must be an integer >= 1`
  (or `in 0..2`), followed by `: why` when given."""
  ok = is_int(value) and value >= minimum and (maximum is None or value <= maximum)
  bound = f'>= {minimum}' if maximum is None else f'in {minimum}..{maximum}'
  require(ok, field, value, f'must be an integer {bound}' + (f': {why}' if why else ''))


def require_number(value, field: str, allowed: str, ok=lambda v: True) -> None:
  """`value` must be a finite real number (not a bool) with `ok(value)`; `allowed` says what is allowed."""
  require(is_number(value) and ok(value), field, value, allowed)
