"""`python -m dspark.serving [serve options]`: the server without going through `dspark serve`."""
import sys

from .cli import main

sys.exit(main())
