import sys
from pathlib import Path

# The scripted tasks in fakes.py are shared by tests/compiler and tests/optimizers.
sys.path.insert(0, str(Path(__file__).parent))
