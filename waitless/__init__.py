"""waitless: distributed SGD that does not wait for stragglers, in JAX/Flax.

The public import path is `waitless.algorithms`, `waitless.cluster`, `waitless.data`, `waitless.models`,
`waitless.experiments` and `waitless.config_errors`. An installed distribution (`pip install .`, or from a git
URL) holds them inside this package (setup.py maps each top-level folder of the repository to `waitless.NAME`),
and installs no top-level `algorithms`, `data`, ... that could clash with a user's own. In a checkout (with the
repository root on PYTHONPATH, or an editable install) they stay the repository's top-level folders: this
package's path then also points at the repository root. Code inside the project imports through `waitless.` too
(`launch/rewrite_imports.py`), so every module has one name, and `except waitless.config_errors.ConfigError`
catches what the algorithms raise.
"""

import os as _os

_HERE = _os.path.dirname(_os.path.abspath(__file__))
_ROOT = _os.path.dirname(_HERE)
if (not _os.path.isdir(_os.path.join(_HERE, 'algorithms'))
    and _os.path.isfile(_os.path.join(_ROOT, 'algorithms', '__init__.py'))):
  __path__.append(_ROOT)  # a checkout: waitless.algorithms is <root>/algorithms
