import sys

from omnid.cli.main import main

sys.exit(main())
