"""``python -m shmbridge.bench {step,peers,vector,learners,stream,gpu,vulkan,...} [--quick] ...``"""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
