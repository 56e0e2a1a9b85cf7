"""Only for the optional C warm path (src/kvspec_traits/_warm.c); metadata is in pyproject.

`optional=True`: on a machine without a C compiler the build goes on and the package uses
its pure-Python warm path.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("kvspec_traits._warm", ["src/kvspec_traits/_warm.c"],
                             optional=True)])
