import sys

from fp8mon.cli import main

sys.exit(main())
