import sys

from onestream.cli import main

sys.exit(main())
