"""`python -m dspark.training {datagen,cache,train} ...` (also the torchrun entry point)."""
import sys

from .cli import main

sys.exit(main())
