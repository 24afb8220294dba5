"""``python -m dspark.scheduling``: serving-simulator sweep of every policy (see simulator.main for options)."""

from .simulator import main

main()
