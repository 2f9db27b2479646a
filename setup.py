"""The package layout of the `waitless` distribution (metadata: pyproject.toml).

Each top-level folder of the repository in `PACKAGES` is installed as `waitless.<folder>`, with its subpackages,
and `waitless/` itself is the parent package (see waitless/__init__.py); nothing is installed at the top level.
`tests/`, `benchmarks/` and `launch/` are tools of a checkout and are not installed.
"""

import setuptools

PACKAGES = ('algorithms', 'cluster', 'data', 'experiments', 'models')

package_dir = {'waitless': 'waitless'}
packages = ['waitless']
for top in PACKAGES:
  package_dir[f'waitless.{top}'] = top
  packages += [f'waitless.{top}'] + [f'waitless.{top}.{sub}' for sub in setuptools.find_packages(top)]

setuptools.setup(packages=packages, package_dir=package_dir)
