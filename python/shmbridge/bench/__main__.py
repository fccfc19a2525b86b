"""``python -m shmbridge.bench {step,peers,vector,learners,gpu,vulkan,...} [--quick] ...``"""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
