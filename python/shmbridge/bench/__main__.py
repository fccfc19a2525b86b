"""``python -m shmbridge.bench {step,peers,vector,gpu,vulkan} [--quick] ...``"""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
