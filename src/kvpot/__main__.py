import sys

from kvpot.cli import main

sys.exit(main())
