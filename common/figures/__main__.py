import sys

from common.figures import main

sys.exit(main())
