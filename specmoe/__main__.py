import sys

from specmoe.cli import main

sys.exit(main())
