"""``python -m kvspec_traits.migrate`` is ``kvspec-traits migrate``."""

import sys

from kvspec_traits.migrate import main

sys.exit(main(sys.argv[1:]))
