"""``python -m kvspec_traits.audit`` is ``kvspec-traits audit``."""

import sys

from kvspec_traits.audit import main

sys.exit(main(sys.argv[1:]))
