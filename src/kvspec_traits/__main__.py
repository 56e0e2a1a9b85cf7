"""``python -m kvspec_traits`` is the ``kvspec-traits`` command."""

import sys

from kvspec_traits._cli import main

sys.exit(main())
