import sys

from istiod.cli import main

sys.exit(main())
