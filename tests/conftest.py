import os
import sys

sys.path.insert(0, os.path.dirname(__file__))  # test-only helpers such as nvfp4_twin
