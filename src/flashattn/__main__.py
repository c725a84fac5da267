import sys

from flashattn.cli import main

sys.exit(main())
