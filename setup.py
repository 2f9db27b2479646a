"""Installs the `waitless` package as it lies on disk (metadata: pyproject.toml).

`tests/`, `benchmarks/`, `examples/` and `launch/` are tools of a checkout and are not installed.
"""

import setuptools

setuptools.setup(packages=setuptools.find_packages(include=['waitless', 'waitless.*']))
