import sys

from pipeir.cli import main

sys.exit(main())
