import sys

from omnid.cli import main

sys.exit(main())
